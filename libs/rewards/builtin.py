"""Built-in text rewards: exact match, regex and format checks, math answer verification with
the ``math-verify`` library, DAPO's soft overlong length penalty, and ``env_reward`` (the reward a
multi-turn environment already gave, carried in the trajectory's metadata).

Each is registered as a factory (config kwargs -> scoring callable). Math-verify is imported on
first use only. Code execution is in ``libs.rewards.code``; reward models in
``libs.rewards.http``.
"""

from __future__ import annotations

import re
import threading
from functools import cache

from libs.rewards.base import RewardError, RewardResult, parse_reference, reference_answer
from pipeline.records import env_reward_text

_WS = re.compile(r"\s+")
FORMAT_PATTERNS = {
    "boxed": r"\\boxed\s*\{",
    "think_answer": r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$",
    "answer_tag": r"<answer>.*?</answer>",
    "code_block": r"```[^\n]*\n.*?```",
}


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _normalise(text: str, whitespace: bool, case_sensitive: bool) -> str:
    text = _WS.sub(" ", text).strip() if whitespace else text
    return text if case_sensitive else text.casefold()


def exact_match(
    reference_key: str = "answer",
    normalize_whitespace: bool = True,
    case_sensitive: bool = False,
    extract: str = "full",
    extract_regex: str | None = None,
):
    """1.0 if the (extracted) response equals ``reference[reference_key]`` (or one of a list of
    answers) after normalisation, else 0.0.

    extract: full | boxed (last ``\\boxed{}``) | last_line. ``extract_regex``: the last match's
    group 1 (or whole match) is compared instead; no match scores 0.
    """
    if extract not in ("full", "boxed", "last_line"):
        raise ValueError(f"extract must be full, boxed or last_line, not {extract!r}")
    rx = re.compile(extract_regex, re.DOTALL) if extract_regex else None

    def score(traj: dict) -> RewardResult:
        ref = parse_reference(traj)
        if reference_key not in ref:
            raise RewardError(f"reference has no {reference_key!r} (keys: {sorted(ref)})")
        answers = ref[reference_key] if isinstance(ref[reference_key], list) else [ref[reference_key]]
        text = traj["response_text"]
        if rx is not None:
            matches = list(rx.finditer(text))
            if not matches:
                return RewardResult(0.0, {"extracted": 0.0})
            m = matches[-1]
            text = m.group(1) if m.groups() else m.group(0)
        elif extract == "boxed":
            text = last_boxed(text)
            if text is None:
                return RewardResult(0.0, {"extracted": 0.0})
        elif extract == "last_line":
            lines = [ln for ln in text.splitlines() if ln.strip()]
            text = lines[-1] if lines else ""
        got = _normalise(text, normalize_whitespace, case_sensitive)
        hit = any(got == _normalise(str(a), normalize_whitespace, case_sensitive) for a in answers)
        return RewardResult(1.0 if hit else 0.0, {"extracted": 1.0})

    return score


def regex(
    pattern: str,
    mode: str = "search",
    ignore_case: bool = False,
    dotall: bool = True,
    on_match: float = 1.0,
    on_miss: float = 0.0,
):
    """``on_match`` if the response matches ``pattern`` (mode: search | match | fullmatch), else ``on_miss``."""
    if mode not in ("search", "match", "fullmatch"):
        raise ValueError(f"mode must be search, match or fullmatch, not {mode!r}")
    flags = (re.IGNORECASE if ignore_case else 0) | (re.DOTALL if dotall else 0)
    try:
        rx = re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"bad pattern {pattern!r}: {exc}") from exc
    matcher = getattr(rx, mode)

    def score(traj: dict) -> RewardResult:
        return RewardResult(on_match if matcher(traj["response_text"]) else on_miss)

    return score


def format_check(style: str = "boxed", max_chars: int | None = None):
    """1.0 if the response has the expected shape: ``boxed`` (a \\boxed{} answer), ``think_answer``
    (``<think>..</think><answer>..</answer>``), ``answer_tag`` or ``code_block``; and, if
    ``max_chars`` is set, is at most that long."""
    if style not in FORMAT_PATTERNS:
        raise ValueError(f"style must be one of {sorted(FORMAT_PATTERNS)}, not {style!r}")
    rx = re.compile(FORMAT_PATTERNS[style], re.DOTALL)

    def score(traj: dict) -> RewardResult:
        text = traj["response_text"]
        ok = rx.search(text) is not None and (max_chars is None or len(text) <= max_chars)
        return RewardResult(1.0 if ok else 0.0)

    return score


# ---- math ---------------------------------------------------------------------------------------
@cache
def _math_verify():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    return parse, verify, [LatexExtractionConfig(), ExprExtractionConfig()]


def _gold_text(answer: str) -> str:
    """Wrap a bare gold answer (``1/2``, ``\\frac12``, ``x^2+1``) in ``$..$`` so math-verify's LaTeX
    extraction finds it; leave ones that already carry delimiters or ``\\boxed``."""
    a = answer.strip()
    if "$" in a or "\\boxed" in a or "\\(" in a or "\\[" in a:
        return a
    return f"${a}$"


def math_answer(
    reference_key: str = "answer",
    float_rounding: int = 6,
    numeric_precision: int = 15,
    strict: bool = True,
    timeout_s: int = 5,
):
    """1.0 if math-verify finds the response's final answer equal to ``reference[reference_key]``.

    Answers may be LaTeX or plain text, ``\\boxed{}`` or not: ``1/2``, ``0.5`` and ``\\frac{1}{2}``
    are equal. ``timeout_s`` is math-verify's own (signal-based) limit, used only in a process's
    main thread; elsewhere the pool's per-call timeout is the only bound. A response without a
    parsable answer scores 0 (details ``parsed=0``); a gold answer that does not parse is an error.
    """

    def score(traj: dict) -> RewardResult:
        parse, verify, extraction = _math_verify()
        main = threading.current_thread() is threading.main_thread()
        t = timeout_s if main else None
        gold_raw = reference_answer(traj, reference_key)
        gold = parse(_gold_text(gold_raw), extraction_config=extraction, parsing_timeout=t)
        if not gold:
            raise RewardError(f"math-verify cannot parse the reference answer {gold_raw!r}")
        pred = parse(traj["response_text"], extraction_config=extraction, parsing_timeout=t)
        if not pred:
            return RewardResult(0.0, {"parsed": 0.0})
        ok = verify(
            gold,
            pred,
            float_rounding=float_rounding,
            numeric_precision=numeric_precision,
            strict=strict,
            timeout_seconds=t,
        )
        return RewardResult(1.0 if ok else 0.0, {"parsed": 1.0})

    return score


def overlong_penalty(max_tokens: int, cache_tokens: int, penalty: float = 1.0):
    """DAPO's soft overlong punishment, by response length ``L`` in tokens: 0 while
    ``L <= max_tokens - cache_tokens``; then linear ``-penalty * (L - (max_tokens - cache_tokens)) /
    cache_tokens`` down to ``-penalty`` at ``L = max_tokens``; ``-penalty`` beyond. Meant as one term
    of a weighted reward next to the task's verifier (``weight = 1``); ``max_tokens`` is usually the
    rollout's response budget, ``cache_tokens`` the soft zone before it (DAPO: 4096 of 20480)."""
    max_tokens, cache_tokens, penalty = int(max_tokens), int(cache_tokens), float(penalty)
    if max_tokens < 1 or not 0 < cache_tokens <= max_tokens or penalty < 0:
        raise ValueError("overlong_penalty needs max_tokens >= 1, 0 < cache_tokens <= max_tokens, penalty >= 0")
    soft = max_tokens - cache_tokens

    def score(trajectory: dict) -> RewardResult:
        n = len(trajectory.get("response_tokens") or b"") // 4  # packed little-endian int32
        if n <= soft:
            value = 0.0
        elif n <= max_tokens:
            value = -penalty * (n - soft) / cache_tokens
        else:
            value = -penalty
        return RewardResult(value, {"response_tokens": float(n)})

    return score


def env_reward(missing: float | None = None):
    """The environment's own reward: the sum of the rewards a multi-turn environment returned for
    its turns (``producers.envs``), which the rollout worker writes into the trajectory's metadata
    as ``env_reward``. A trajectory without it (a single-turn task) is a RewardError, so it is
    dead-lettered, unless ``missing`` gives the value to use instead."""

    def score(trajectory: dict) -> RewardResult:
        raw = env_reward_text(trajectory)
        if raw is None:
            if missing is None:
                raise RewardError("trajectory has no env_reward in its metadata (not from a multi-turn env?)")
            return RewardResult(float(missing))
        try:
            return RewardResult(float(raw))
        except ValueError as exc:
            raise RewardError(f"env_reward {raw!r} is not a number") from exc

    return score
