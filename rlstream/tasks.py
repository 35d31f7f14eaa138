"""Built-in, procedurally generated tasks: small verifiable datasets written as JSONL, so examples and
tests run without downloading anything.

* ``next_digit``: ``7>`` → ``8`` (the demo's task: 10 prompts, answer = the next digit mod 10).
* ``guess_number``: episodes of the built-in multi-turn environment (producers.envs).
* ``arithmetic``: ``3+4=`` or ``three plus four=`` → ``7``: additions (and optionally subtractions)
  of small numbers, written in digits or in words, the answer as digits, scored by the math
  verifier. With ``max_result`` 9 every answer is one character, which the tiny character-level
  model can learn by RL alone on a CPU. ``forms = "both"`` writes every problem in both forms, the
  word forms first, so a job's ``held_out`` share tests transfer from digits to words.

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
    seed: int = 0,
    max_operand: int = 9,
    max_result: int = 9,
    words: float = 0.5,
    subtract: bool = False,
    forms: str = "one",
) -> list[dict]:
    """Every a+b (and a-b with ``subtract``) with operands <= ``max_operand`` and a result in
    [0, ``max_result``]. ``forms = "one"``: each problem once, in words with probability ``words``,
    else in digits, in a seeded random order. ``forms = "both"``: each problem twice, in digits and
    (operands up to ten) in words, the word forms first: a job's ``held_out`` share (taken from the
    front, at most the word forms' share) then holds out word problems whose digit twins are trained,
    so the eval measures whether what was learned in digits carries over to words."""
    if forms not in ("one", "both"):
        raise ValueError(f"arithmetic: forms must be 'one' or 'both', not {forms!r}")
    rng = random.Random(seed)
    ops = [("+", "plus", lambda a, b: a + b)] + ([("-", "minus", lambda a, b: a - b)] if subtract else [])
    out, word_forms = [], []
    for sym, word, fn in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                r = fn(a, b)
                if not 0 <= r <= max_result:
                    continue
                ref = {"answer": str(r)}
                digits = {"id": f"{a}{sym}{b}", "prompt": f"{a}{sym}{b}=", "task": "arithmetic", "reference": ref}
                in_words = {"id": f"{a}{sym}{b}w", "prompt": f"{WORDS[a]} {word} {WORDS[b]}=", "task": "arithmetic",
                            "reference": ref} if max(a, b) < len(WORDS) else None  # fmt: skip
                if forms == "both":
                    out.append(digits)
                    word_forms += [in_words] if in_words else []
                else:
                    out.append(in_words if rng.random() < words and in_words else digits)
    rng.shuffle(word_forms)
    rng.shuffle(out)
    return word_forms + out


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
