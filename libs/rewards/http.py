"""Reward models behind HTTP: ``http`` (POST JSON to an endpoint, read the score at a path in the
reply) and ``openai_judge`` (an OpenAI-compatible ``/chat/completions`` call whose reply holds a
number, e.g. a judge model served by vLLM).

Both use the standard library's urllib, with a per-request timeout and retries with exponential
backoff on connection errors, timeouts, HTTP 429 and 5xx. Other HTTP errors and unusable replies
raise RewardError (the trajectory goes to the DLQ). No batching across trajectories.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request

from libs.rewards.base import RewardError, RewardResult

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
JUDGE_SYSTEM = "You grade answers. Reply with only a number from 0 to {max_score}."
JUDGE_TEMPLATE = (
    "Question:\n{prompt}\n\nReference (may be empty):\n{reference}\n\nAnswer to grade:\n{response}\n\nScore:"
)


def post_json(
    url: str,
    body: dict,
    *,
    headers: dict | None = None,
    timeout_s: float = 10.0,
    retries: int = 2,
    backoff_s: float = 0.2,
    trust_env: bool = True,
) -> dict | list:
    """POST ``body`` as JSON and return the decoded reply; retry transient failures."""
    opener = urllib.request.build_opener(*(() if trust_env else (urllib.request.ProxyHandler({}),)))
    data = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    last = "no attempt"
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data=data, headers=hdrs, method="POST")
        try:
            with opener.open(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", errors="replace")
            last = f"HTTP {exc.code} {exc.reason}: {detail}"
            if exc.code == 429 or exc.code >= 500:
                continue
            raise RewardError(f"POST {url}: {last}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            continue
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RewardError(f"POST {url}: reply is not JSON: {raw[:200]!r}") from exc
    raise RewardError(f"POST {url}: failed after {retries + 1} attempt(s); last: {last}")


def dig(obj, path: str):
    """``obj`` at a dotted path; list indices are numbers (``results.0.score``). RewardError if absent."""
    cur = obj
    for part in [p for p in path.split(".") if p]:
        try:
            cur = cur[int(part)] if isinstance(cur, list) else cur[part]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise RewardError(f"reply has no {path!r} (failed at {part!r})") from exc
    return cur


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"{what} is not a number: {value!r}")
    return float(value)


def http_reward(
    url: str,
    score_path: str = "score",
    details_path: str | None = None,
    headers: dict | None = None,
    extra: dict | None = None,
    timeout_s: float = 10.0,
    retries: int = 2,
    backoff_s: float = 0.2,
    scale: float = 1.0,
    offset: float = 0.0,
    trust_env: bool = True,
):
    """POST ``{"prompt", "response", "reference", "task", "trajectory_id", **extra}`` to ``url``;
    reward = ``scale * reply[score_path] + offset``. ``details_path`` may name a dict of numbers."""

    def score(traj: dict) -> RewardResult:
        body = {
            "prompt": traj["prompt_text"],
            "response": traj["response_text"],
            "reference": traj.get("reference", ""),
            "task": traj.get("task", ""),
            "trajectory_id": traj.get("trajectory_id", ""),
            **(extra or {}),
        }
        reply = post_json(
            url, body, headers=headers, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, trust_env=trust_env
        )
        value = _number(dig(reply, score_path), score_path)
        details = {}
        if details_path:
            raw = dig(reply, details_path)
            if not isinstance(raw, dict):
                raise RewardError(f"{details_path!r} is not an object")
            details = {str(k): _number(v, f"{details_path}.{k}") for k, v in raw.items()}
        return RewardResult(scale * value + offset, details)

    return score


def openai_judge(
    base_url: str,
    model: str,
    api_key: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    system_prompt: str = JUDGE_SYSTEM,
    template: str = JUDGE_TEMPLATE,
    max_score: float = 10.0,
    temperature: float = 0.0,
    max_tokens: int = 16,
    timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    trust_env: bool = True,
):
    """Ask an OpenAI-compatible chat endpoint (``{base_url}/chat/completions``) to grade the
    response; reward = first number in the reply / ``max_score``, clipped to [0, 1]. The template
    gets ``{prompt}``, ``{response}`` and ``{reference}``."""
    if max_score <= 0:
        raise ValueError("max_score must be > 0")
    url = base_url.rstrip("/") + "/chat/completions"

    def score(traj: dict) -> RewardResult:
        key = api_key or os.environ.get(api_key_env, "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        user = template.format(
            prompt=traj["prompt_text"], response=traj["response_text"], reference=traj.get("reference", "")
        )
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": system_prompt.format(max_score=max_score)},
                {"role": "user", "content": user},
            ],
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        reply = post_json(
            url, body, headers=headers, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, trust_env=trust_env
        )
        content = dig(reply, "choices.0.message.content")
        m = _NUMBER.search(str(content))
        if m is None:
            raise RewardError(f"judge reply has no number: {str(content)[:200]!r}")
        raw = float(m.group(0))
        return RewardResult(min(1.0, max(0.0, raw / max_score)), {"judge_score": raw})

    return score
