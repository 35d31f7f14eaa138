"""Built-in, procedurally generated tasks: small verifiable datasets written as JSONL, so examples and
tests run without downloading anything.

* ``next_digit``: ``7>`` → ``8`` (the demo's task: 10 prompts, answer = the next digit mod 10).
* ``guess_number``: episodes of the built-in multi-turn environment (producers.envs).
* ``textarena``: ``count`` games of the ``textarena`` environment (producers.textarena_env), one
  seed each in the reference: the game itself is named by the environment's options.
* ``arithmetic``: ``3+4=`` or ``three plus four=`` → ``7``: additions (and optionally subtractions)
  of small numbers, written in digits or in words, the answer as digits, scored by the math
  verifier. With ``max_result`` 9 every answer is one character, which the tiny character-level
  model can learn by RL alone on a CPU. ``forms = "both"`` writes every problem in both forms, the
  word forms first, so a job's ``held_out`` share tests transfer from digits to words.

* ``reasoning_gym``: any dataset of the reasoning-gym library by name (``dataset``, its ``config``),
  as chat records (a system message asking for an answer format, the question as the user message),
  scored by the ``reasoning_gym`` reward with the dataset's own ``score_answer``. The held-out split
  comes from another seed, and no held-out question is also a training question.

* ``tool_use``: demonstrations for a supervised stage: reasoning-gym arithmetic (sums and products of
  multi-digit numbers) answered by calling the calculator tool (``feed.mode = "sft"``); its held-out
  split holds the prompts only.

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


def textarena(seed: int = 0, count: int = 50, task: str = "textarena", prompt: str = "Play the game.\n") -> list[dict]:
    """``count`` episodes of the ``textarena`` environment, each a game seed (``reference.seed``)
    drawn from ``seed``; the game (``env_id``) is the environment's option, and ``prompt`` only
    labels the record (the model sees the game's own opening)."""
    rng = random.Random(seed)
    return [
        {"id": f"ta{i}", "prompt": prompt, "task": task, "reference": {"seed": rng.randrange(2**31)}}
        for i in range(count)
    ]


def reasoning_gym(
    dataset: str = "chain_sum",
    config: dict | None = None,
    size: int = 2000,
    eval_size: int = 100,
    seed: int = 0,
    eval_seed: int = 1_000_003,
    answer_format: str = "boxed",
    system_prompt: str | None = None,
    example: bool = True,
    task: str = "reasoning_gym",
) -> dict[str, list[dict]]:
    """``size`` training and ``eval_size`` held-out records of the reasoning-gym dataset ``dataset``
    (``config``: its options, e.g. ``{min_digits = 1, max_digits = 1}``), generated from ``seed``
    and ``eval_seed``. Training records whose question is also a held-out question are dropped, so
    the eval measures generalisation even on small problem spaces. ``system_prompt`` replaces the
    answer format's instruction (keep it asking for the same format). ``example``: one worked turn
    (a question of the same dataset from a third seed, answered only in the format) before the
    question: small instruct models ignore a format asked for in words alone (SmolLM2-135M wrote
    ``\\boxed{}`` for 0 of 32 questions without it and 32 of 32 with it). Neither split uses that
    question."""
    try:
        import reasoning_gym as rg
    except ImportError as exc:
        raise ValueError("the reasoning_gym generator needs reasoning-gym: bash scripts/setup.sh --real-model") from exc
    from libs.rewards.reasoning_gym import format_answer, instruction

    config = dict(config or {})
    system = system_prompt if system_prompt is not None else instruction(answer_format)
    shot = []
    if example:
        e = _rg_entries(rg, dataset, config, 1, seed + eval_seed + 1)[0]
        shot = [{"role": "user", "content": e["question"]},
                {"role": "assistant", "content": f"The answer is {format_answer(str(e['answer']), answer_format)}."}]  # fmt: skip

    def records(n: int, s: int, tag: str) -> list[dict]:
        out = []
        for i, e in enumerate(_rg_entries(rg, dataset, config, n, s)):
            if shot and e["question"] == shot[0]["content"]:
                continue
            entry = {"question": e["question"], "answer": e["answer"], "metadata": e.get("metadata", {})}
            out.append({
                "id": f"{dataset}-{tag}{i}",
                "messages": [{"role": "system", "content": system}, *shot, {"role": "user", "content": e["question"]}],
                "task": task,
                "reference": {"answer": str(e["answer"]), "reasoning_gym": {
                    "dataset": dataset, "config": config, "answer_format": answer_format, "entry": entry}},
            })  # fmt: skip
        return out

    held = records(eval_size, eval_seed, "e")
    questions = {r["messages"][-1]["content"] for r in held}
    train = [r for r in records(size, seed, "t") if r["messages"][-1]["content"] not in questions]
    if not train:
        raise ValueError(f"reasoning-gym {dataset}: every training question is also held out; widen its config")
    return {"train": train, "eval": held}


TOOL_USE_CONFIG = {"min_terms": 2, "max_terms": 4, "min_digits": 2, "max_digits": 3, "operators": ["+", "-", "*"]}
"""The ``tool_use`` generator's default basic_arithmetic options: multi-digit sums and products."""


def tool_use(
    dataset: str = "basic_arithmetic",
    config: dict | None = None,
    size: int = 500,
    eval_size: int = 100,
    seed: int = 0,
    eval_seed: int = 1_000_003,
    answer_format: str = "boxed",
    two_calls: float = 0.25,
    system_prompt: str | None = None,
    task: str = "reasoning_gym",
) -> dict[str, list[dict]]:
    """Demonstrations of calculator use for a supervised stage (``feed.mode = "sft"``): the
    ``reasoning_gym`` generator's records (no worked example) of an arithmetic dataset whose entries
    carry their ``expression`` (``basic_arithmetic``, ``chain_sum``), each training record followed
    by the assistant calling ``calculator`` with the expression (OpenAI ``tool_calls``), the tool's
    result, and the answer in ``answer_format``. A share ``two_calls`` of them computes the left
    operand of the top-level operation first, then the rest with its result. The held-out split
    (``eval_seed``, no training question in it) holds the prompts only, as RL and eval see them.
    Run the job's task in the ``tools`` environment with the ``calculator`` tool, so the feed
    renders the tools as a live episode shows them."""
    import ast

    from libs.rewards.reasoning_gym import format_answer
    from libs.tools.builtin import calculator

    config = dict(TOOL_USE_CONFIG if config is None and dataset == "basic_arithmetic" else config or {})
    out = reasoning_gym(dataset, config, size, eval_size, seed, eval_seed, answer_format, system_prompt, False, task)
    rng = random.Random(seed)
    symbols = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}

    def call(i: int, expression: str) -> list[dict]:
        cid = f"call_{i}"
        args = json.dumps({"expression": expression})
        return [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": "calculator", "arguments": args}}]},
            {"role": "tool", "tool_call_id": cid, "name": "calculator", "content": calculator(expression)},
        ]  # fmt: skip

    train = []
    for r in out["train"]:
        entry = r["reference"]["reasoning_gym"]["entry"]
        expr = (entry.get("metadata") or {}).get("expression")
        if not expr:
            raise ValueError(f"tool_use: reasoning-gym {dataset} entries carry no expression")
        body = ast.parse(expr, mode="eval").body
        split = isinstance(body, ast.BinOp) and type(body.op) in symbols and isinstance(body.left, ast.BinOp)
        if split and rng.random() < two_calls:
            left = ast.unparse(body.left)
            right = ast.unparse(body.right)
            right = f"({right})" if isinstance(body.right, ast.BinOp) else right
            turns = call(0, left)
            turns += call(1, f"{turns[-1]['content']} {symbols[type(body.op)]} {right}")
        else:
            turns = call(0, expr)
        if turns[-1]["content"] != str(entry["answer"]):
            continue  # the calculator disagrees with the dataset (e.g. a rounded division): no demonstration
        final = f"The answer is {format_answer(str(entry['answer']), answer_format)}."
        train.append({**r, "messages": [*r["messages"], *turns, {"role": "assistant", "content": final}]})
    return {"train": train, "eval": out["eval"]}


def _rg_entries(rg, dataset: str, config: dict, size: int, seed: int) -> list[dict]:
    try:
        return list(rg.create_dataset(dataset, size=size, seed=seed, **config))
    except Exception as exc:  # an unknown name or option: the job file is at fault
        raise ValueError(f"reasoning-gym dataset {dataset!r} with config {config}: {exc}") from exc


GENERATORS = {
    "next_digit": next_digit,
    "arithmetic": arithmetic,
    "guess_number": guess_number,
    "textarena": textarena,
    "reasoning_gym": reasoning_gym,
    "tool_use": tool_use,
}


def write(generator: str, path: Path, **options) -> Path:
    """Write the named generator's records to ``path`` (JSONL); ValueError for an unknown name."""
    if generator not in GENERATORS:
        raise ValueError(f"unknown task generator {generator!r}; built-ins: {', '.join(sorted(GENERATORS))}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = GENERATORS[generator](**options)
    if isinstance(records, dict):  # a generator with its own held-out split
        records = records["train"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
