"""Held-out episodes through a job's environment: the evaluator's multi-turn driver.

For a held-out prompt whose task maps to an environment (``rollout.env.tasks``), the evaluator
plays whole episodes rather than one completion: ``env.reset(prompt)`` gives the opening, the
engine writes a model turn (at most ``rollout.env.max_turn_tokens``, ending at EOS or at
``rollout.env.stop`` as the rollout worker's turns do), ``env.step(turn)`` answers with an
observation that is appended, and so on until the environment says done, the model ends the
episode with EOS (an environment whose ``eos_ends_episode`` says so), ``rollout.env.max_turns``
turns or the answer budget. All episodes of an evaluation advance together, one batched
generation per turn; each ``env.step`` runs on a thread of its own with the deadline
``rollout.env.step_timeout_s``, and one that raises or runs past it ends its own episode
(``env_error`` / ``env_timeout``, kept in the answers file) and no other.

The environment classes are the job's own (the evaluator is handed the factory that maps a
``rollout.env.tasks`` spec to a class), so a tool environment here calls the same tools, parses
the same call format and counts the same ``info["counts"]`` as in training.

What this is not: the rollout worker's asynchronous episode loop (no Kafka, no weight updates
mid-episode, no logprobs), nor a scorer: the episode's text (model turns and observations, as a
trajectory's ``response_text``) is scored by the reward functions afterwards.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

FAILED_CALLS = ("tool_errors", "tool_timeouts", "tool_memory", "tool_crashes")
"""``info["counts"]`` of well-formed calls that returned no result."""


@dataclass(eq=False)
class Episode:
    rid: str
    env: Any
    prompt_tokens: list[int]
    budget: int
    """Most tokens of the whole episode after the opening (model turns and observations)."""
    tokens: list[int] = field(default_factory=list)
    """Model turns and observations after the opening."""
    model_tokens: int = 0
    turns: int = 0
    transcript: list[dict] = field(default_factory=list)
    """``{"role": "model" | "env", "text": ...}`` in order."""
    counts: dict[str, int] = field(default_factory=dict)
    """The environment's ``info["counts"]`` added up over the episode."""
    env_reward: float = 0.0
    finish: str | None = None
    """stop | length | env_done | max_turns | env_error | env_timeout."""
    error: str = ""


def start(env, prompt: dict, sample_index: int, tokenizer, rid: str, budget: int, max_len: int) -> Episode:
    """Reset ``env`` for one sample of ``prompt`` and return its episode (an env whose ``reset``
    raises gives an episode already ended with ``env_error``)."""
    try:
        text = env.reset(prompt, sample_index)
    except Exception as exc:  # this episode is lost (said in the answers file); the others go on
        ep = Episode(rid, env, [], 0, finish="env_error", error=f"env.reset: {type(exc).__name__}: {exc}")
        return ep
    toks = tokenizer(text, add_special_tokens=not env.renders_chat).input_ids
    ep = Episode(rid, env, toks, min(budget, max_len - len(toks)))
    ep.transcript.append({"role": "env", "text": text})
    if ep.budget <= 0:
        ep.finish = "length"
    return ep


def _steps(pairs: list[tuple[Episode, str]], timeout_s: float) -> list[tuple[Any, str | None, str]]:
    """Run ``env.step(action)`` of each pair on its own daemon thread; wait until all have
    returned or the deadline passed. Per pair: (StepResult or None, error_type, reason)."""
    out: list[list] = [[None, "env_timeout", f"env.step ran past rollout.env.step_timeout_s = {timeout_s:g}s"]
                       for _ in pairs]  # fmt: skip

    def one(i: int, ep: Episode, action: str) -> None:
        try:
            out[i] = [ep.env.step(action), None, ""]
        except BaseException as exc:  # an environment's failure ends its episode only
            out[i] = [None, "env_error", f"{type(exc).__name__}: {exc}"]

    threads = [threading.Thread(target=one, args=(i, ep, a), daemon=True, name="eval-env-step")
               for i, (ep, a) in enumerate(pairs)]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [tuple(o) for o in out]


def play(episodes: list[Episode], engine, tokenizer, *, temperature: float, max_turns: int, max_turn_tokens: int,
         stop_ids: frozenset[int], chat_eos_only: bool, step_timeout_s: float, gen_timeout_s: float,
         tick=None) -> None:  # fmt: skip
    """Play ``episodes`` to their end, all together: one batched generation per turn, then the
    turns' env steps in parallel. ``stop_ids``: the tokens besides EOS that end a model turn;
    with ``chat_eos_only`` (``rollout.env.stop`` unset) the turns of an environment that renders
    the chat itself end at EOS only. ``tick`` is called between generation chunks (a sign of life)."""
    from libs.engines import GenRequest

    eos = tokenizer.eos_token_id
    while active := [e for e in episodes if e.finish is None]:
        reqs = []
        for e in active:
            left = min(e.budget - len(e.tokens), max_turn_tokens)
            stops = frozenset({eos}) | (frozenset() if chat_eos_only and e.env.renders_chat else stop_ids)
            reqs.append(
                GenRequest(f"{e.rid}#{e.turns + 1}", e.prompt_tokens + e.tokens, max(1, left), temperature, stops)
            )
        outs = []
        for i in range(0, len(reqs), 64):  # in chunks, with a sign of life between them
            outs += engine.generate(reqs[i : i + 64], timeout=gen_timeout_s)
            if tick is not None:
                tick()
        pending = []
        for e, out in zip(active, outs, strict=True):
            e.tokens.extend(out.tokens)
            e.model_tokens += len(out.tokens)
            e.turns += 1
            text = tokenizer.decode(out.tokens)
            e.transcript.append({"role": "model", "text": text})
            if out.tokens and out.tokens[-1] == eos and e.env.eos_ends_episode:
                e.finish = "stop"
            elif len(e.tokens) >= e.budget:
                e.finish = "length"
            else:
                pending.append((e, text))
        for (e, _), (res, error_type, reason) in zip(pending, _steps(pending, step_timeout_s), strict=True):
            if error_type is not None:
                e.finish, e.error = error_type, reason
                continue
            for name, n in ((res.info or {}).get("counts") or {}).items():
                e.counts[name] = e.counts.get(name, 0) + int(n)
            e.env_reward += res.reward
            if res.observation:
                obs = tokenizer(res.observation, add_special_tokens=False).input_ids
                e.tokens.extend(obs[: max(0, e.budget - len(e.tokens))])
                e.transcript.append({"role": "env", "text": res.observation})
            if res.done:
                e.finish = "env_done"
            elif len(e.tokens) >= e.budget:
                e.finish = "length"
            elif e.turns >= max_turns:
                e.finish = "max_turns"


def tool_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The tool-use figures of an evaluation's episodes, from their ``info["counts"]``:
    ``eval_tool_call_rate`` (share of episodes with at least one well-formed call),
    ``eval_tool_call_success`` (share of well-formed calls that returned a result, no tool error,
    timeout, memory limit or crash), ``eval_malformed_call_rate`` (share of attempted calls that
    could not be read), ``eval_turns_mean`` (model turns per episode) and ``eval_episodes``."""
    n = len(episodes)
    calls = sum(e.counts.get("tool_calls", 0) for e in episodes)
    malformed = sum(e.counts.get("malformed_tool_calls", 0) for e in episodes)
    failed = sum(e.counts.get(k, 0) for e in episodes for k in FAILED_CALLS)
    return {
        "eval_episodes": n,
        "eval_tool_call_rate": sum(e.counts.get("tool_calls", 0) > 0 for e in episodes) / n if n else 0.0,
        "eval_tool_call_success": max(0, calls - failed) / calls if calls else 0.0,
        "eval_malformed_call_rate": malformed / (calls + malformed) if calls + malformed else 0.0,
        "eval_turns_mean": sum(e.turns for e in episodes) / n if n else 0.0,
    }
