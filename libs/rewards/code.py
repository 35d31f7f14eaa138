"""The ``code`` reward: run the program in the response against the reference's test cases in the
sandbox (``libs.rewards.sandbox``) and score the fraction (or all-or-nothing) passed.

Reference formats: ``{"tests": [{"input": "...", "output": "..."}, ...]}`` or
``{"inputs": [...], "outputs": [...]}``. The program is the last fenced code block of the
response (```python ... ``` preferred), else the whole response. Output comparison ignores
trailing whitespace on each line and trailing blank lines. A program that hangs, forks, eats
memory or floods output fails its test case; it never raises here.
"""

from __future__ import annotations

import re

from libs.rewards.base import RewardError, RewardResult, parse_reference
from libs.rewards.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last ```python block, else the last fenced block, else the text itself."""
    blocks = _FENCE.findall(text)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return text


def normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def test_cases(ref: dict) -> list[tuple[str, str]]:
    if "tests" in ref:
        cases = [(str(t.get("input", "")), str(t["output"])) for t in ref["tests"]]
    elif "inputs" in ref and "outputs" in ref:
        if len(ref["inputs"]) != len(ref["outputs"]):
            raise RewardError("reference inputs and outputs differ in length")
        cases = [(str(i), str(o)) for i, o in zip(ref["inputs"], ref["outputs"], strict=True)]
    else:
        raise RewardError(f"reference has no tests (keys: {sorted(ref)})")
    if not cases:
        raise RewardError("reference has an empty test list")
    return cases


def code_tests(partial: bool = False, stop_on_failure: bool | None = None, sandbox=None, **limits):
    """Score the response's program on the reference tests.

    partial: reward = passed / total (else 1.0 only if every test passes). stop_on_failure
    (default: not partial) skips the remaining tests after a failure. ``limits`` override the
    sandbox defaults (wall_s, cpu_s, memory_mb, max_processes, max_output_bytes, ...); the worker
    passes its ``reward.sandbox`` config as ``sandbox``. Keep ``tests x wall_s`` below the
    worker's ``reward.timeout_s``.
    """
    lim = SandboxLimits.from_config(sandbox, **limits)
    stop = (not partial) if stop_on_failure is None else stop_on_failure

    def score(traj: dict) -> RewardResult:
        cases = test_cases(parse_reference(traj))
        program = extract_code(traj["response_text"])
        passed, counts = 0, dict.fromkeys(("timeout", "cpu_limit", "output_limit", "runtime_error"), 0)
        for stdin, expected in cases:
            res = run_python(program, stdin, lim)
            if res.status == "setup_error":
                raise RewardError(f"sandbox setup failed: {res.stderr.strip()[-500:]}")
            if res.status in counts:
                counts[res.status] += 1
            if res.ok and normalise_output(res.stdout) == normalise_output(expected):
                passed += 1
            elif stop:
                break
        total = len(cases)
        reward = passed / total if partial else float(passed == total)
        return RewardResult(reward, {"passed": float(passed), "total": float(total), **counts})

    return score
