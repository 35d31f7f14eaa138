"""Built-in, procedurally generated tasks: small verifiable datasets written as JSONL, so examples and
tests run without downloading anything.

* ``next_digit``: ``7>`` → ``8`` (the demo's task: 10 prompts, answer = the next digit mod 10).
* ``guess_number``: episodes of the built-in multi-turn environment (producers.envs).
* ``arithmetic``: ``3+4=`` or ``three plus four=`` → ``7``: additions (and optionally subtractions)
  of small numbers, written in digits or in words, the answer as digits, scored by the math
  verifier. With ``max_result`` 9 every answer is one character, which the tiny character-level
  model can learn by RL alone on a CPU.

A job names one with ``[job.dataset] generator = "arithmetic"`` (its options beside it); the file is
written into the run directory and fed like any dataset. What this is not: a benchmark suite.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def next_digit(seed: int = 0) -> list[dict]:
    digits = list(range(10))
    random.Random(seed).shuffle(digits)
    return [
        {"id": f"d{d}", "prompt": f"{d}>", "task": "next_digit", "reference": {"answer": str((d + 1) % 10)}}
        for d in digits
    ]


def arithmetic(
    seed: int = 0, max_operand: int = 9, max_result: int = 9, words: float = 0.5, subtract: bool = False
) -> list[dict]:
    """Every a+b (and a-b with ``subtract``) with operands <= ``max_operand`` and a result in
    [0, ``max_result``], each in digits or, with probability ``words``, in words."""
    rng = random.Random(seed)
    ops = [("+", "plus", lambda a, b: a + b)] + ([("-", "minus", lambda a, b: a - b)] if subtract else [])
    out = []
    for sym, word, fn in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                r = fn(a, b)
                if not 0 <= r <= max_result:
                    continue
                in_words = rng.random() < words and max(a, b) < len(WORDS)
                text = f"{WORDS[a]} {word} {WORDS[b]}=" if in_words else f"{a}{sym}{b}="
                out.append({"id": f"{a}{sym}{b}{'w' if in_words else ''}", "prompt": text, "task": "arithmetic",
                            "reference": {"answer": str(r)}})  # fmt: skip
    rng.shuffle(out)
    return out


def guess_number(seed: int = 0, count: int = 50, lo: int = 1, hi: int = 20) -> list[dict]:
    """Episodes of the built-in guess-the-number environment (each its own secret in [lo, hi])."""
    rng = random.Random(seed)
    return [
        {"id": f"g{i}", "prompt": f"Guess my number ({lo}-{hi}):\n", "task": "guess_number",
         "reference": {"lo": lo, "hi": hi, "secret": rng.randint(lo, hi)}}
        for i in range(count)
    ]  # fmt: skip


GENERATORS = {"next_digit": next_digit, "arithmetic": arithmetic, "guess_number": guess_number}


def write(generator: str, path: Path, **options) -> Path:
    """Write the named generator's records to ``path`` (JSONL); ValueError for an unknown name."""
    if generator not in GENERATORS:
        raise ValueError(f"unknown task generator {generator!r}; built-ins: {', '.join(sorted(GENERATORS))}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in GENERATORS[generator](**options)))
    return path
