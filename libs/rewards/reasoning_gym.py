"""reasoning-gym tasks: the answer formats a prompt asks for, their strict extraction, and the
``reasoning_gym`` reward, which scores an extracted answer with the dataset's own ``score_answer``.

One owner for the answer format: ``ANSWER_FORMATS`` holds, per format, the instruction a prompt's
system message carries and the extractor the reward applies, so the dataset generator
(``rlstream.tasks.reasoning_gym``) and the reward can never disagree about it.

Extraction is strict so that the format cannot be gamed: exactly one answer block (two blocks, even
equal ones, score 0: a model must not hedge with several answers), an answer of at most
``max_answer_chars`` characters, and nothing but whitespace and closing punctuation may follow the
block (a model must not append a second attempt after it). The reference of a reasoning-gym record
holds the dataset's name, its config and the entry (``question``, ``answer``, ``metadata``); the
dataset object that scores it is built once per (name, config), with reasoning-gym imported on first
use only. What this is not: a generator of data (``rlstream.tasks``) nor a sandbox.
"""

from __future__ import annotations

import json
import re
from functools import cache

from libs.rewards.base import RewardError, RewardResult, parse_reference

ANSWER_FORMATS = {
    "boxed": "Solve the problem. Write your final answer as \\boxed{ANSWER}, once, at the end.",
    "answer_tag": "Solve the problem. Write your final answer between <answer> and </answer>, once, at the end.",
}
_BLOCK = {
    "boxed": re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}", re.DOTALL),
    "answer_tag": re.compile(r"<answer>(.*?)</answer>", re.DOTALL),
}
_TAIL_OK = re.compile(r"^[\s.!)\]$*`]*$")


def instruction(answer_format: str) -> str:
    """The system prompt of a reasoning-gym record in ``answer_format``."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {sorted(ANSWER_FORMATS)}, not {answer_format!r}")
    return ANSWER_FORMATS[answer_format]


def format_answer(answer: str, answer_format: str) -> str:
    """``answer`` written in ``answer_format`` (what a worked example shows the model)."""
    return f"\\boxed{{{answer}}}" if answer_format == "boxed" else f"<answer>{answer}</answer>"


def extract(text: str, answer_format: str, max_answer_chars: int = 200) -> tuple[str | None, str]:
    """(answer, why): the one answer block's content, or None and the reason it was refused."""
    blocks = list(_BLOCK[answer_format].finditer(text))
    if not blocks:
        return None, "no_answer"
    if len(blocks) > 1:
        return None, "several_answers"
    block = blocks[0]
    if not _TAIL_OK.match(text[block.end() :]):
        return None, "text_after_answer"
    answer = block.group(1).strip()
    if not answer or len(answer) > max_answer_chars:
        return None, "answer_length"
    return answer, "ok"


@cache
def _scorer(name: str, config_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json)).score_answer


def score_entry(name: str, config: dict, answer: str | None, entry: dict) -> float:
    """The dataset's own ``score_answer`` in [0, 1]; RewardError if the dataset or entry is unusable."""
    try:
        fn = _scorer(name, json.dumps(config, sort_keys=True))
    except Exception as exc:  # unknown dataset or bad config: the record is at fault, dead-letter it
        raise RewardError(f"reasoning-gym dataset {name!r} with config {config}: {type(exc).__name__}: {exc}") from exc
    value = float(fn(answer, entry))
    if not 0.0 <= value <= 1.0:
        raise RewardError(f"reasoning-gym {name} scored {value}, outside [0, 1]")
    return value


def reasoning_gym_reward(answer_format: str | None = None, format_bonus: float = 0.0, max_answer_chars: int = 200):
    """Score with the record's reasoning-gym dataset: the strictly extracted answer (``extract``)
    through the dataset's ``score_answer``. A refused or missing answer scores 0 (details say why).
    ``answer_format``: ``boxed`` or ``answer_tag``; None = the one the record was generated with.
    ``format_bonus``: added to a well-formed answer that scores below 1, capped at 1 (a shaping
    term for models that must first learn the format; 0 = off)."""
    if answer_format is not None:
        instruction(answer_format)
    if not 0.0 <= format_bonus < 1.0:
        raise ValueError("format_bonus must be in [0, 1)")

    def score(trajectory: dict) -> RewardResult:
        ref = parse_reference(trajectory)
        rg = ref.get("reasoning_gym")
        if not isinstance(rg, dict) or not {"dataset", "entry"} <= rg.keys():
            raise RewardError("reference has no reasoning_gym {dataset, entry} (not a reasoning-gym record?)")
        fmt = answer_format or rg.get("answer_format", "boxed")
        if fmt not in _BLOCK:
            raise RewardError(f"unknown answer_format {fmt!r} in the reference")
        answer, why = extract(trajectory["response_text"], fmt, max_answer_chars)
        if answer is None:
            return RewardResult(0.0, {"formatted": 0.0, f"refused_{why}": 1.0})
        value = score_entry(rg["dataset"], rg.get("config") or {}, answer, rg["entry"])
        if value < 1.0 and format_bonus:
            value = min(1.0, value + format_bonus)
        return RewardResult(value, {"formatted": 1.0})

    return score
