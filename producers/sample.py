"""One sample in a rollout worker: its token state across turns, partial rollouts and versions,
and the Trajectory record it becomes.

A sample is an episode of one or more model turns. Single-turn samples are one turn that ends
on EOS or the token budget. Multi-turn samples (an ``Environment`` is attached) alternate model
turns (ended by EOS, a stop token or ``max_turn_tokens``) and observations, which are appended
with loss_mask 0 and logprob 0. EOS ends the episode unless the environment says otherwise
(``Environment.eos_ends_episode``: a chat environment's assistant messages all end in EOS).
``max_new_tokens`` bounds all response tokens of the episode. An environment that fails marks
the sample ``failed``: the worker dead-letters it instead of publishing it.

A turn aborted by a weight reload (``interrupt``) keeps its tokens; the next request continues
it under the new weights, so version_min < version_max and ``metadata["versions"]`` lists
``index@version`` where each version's tokens start. A single-turn sample the new version makes
certain to be stale can instead ``restart`` from its prompt (``rollout.stale_restarts``).

What this is not: Kafka or engine code; the worker moves samples between those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.engines.base import GenOutput, GenRequest
from pipeline import codec
from pipeline.control import now_ms
from pipeline.records import (
    DRAW_KEY,
    ENV_REWARD_KEY,
    QUORUM_KEY,
    VERSIONS_KEY,
    format_env_reward,
    format_version_marks,
)
from producers.envs import Environment, StepResult


@dataclass
class Sample:
    prompt: dict
    """The decoded Prompt record."""
    index: int
    """sample_index within the group."""
    prompt_tokens: list[int]
    budget: int
    """Most response tokens (model and environment) of the episode."""
    tp: tuple[str, int]
    offset: int
    env: Environment | None = None
    max_turns: int = 1
    max_turn_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    turn_tokens: int = 0
    """Tokens of the current (possibly interrupted) turn."""
    version_min: int | None = None
    version_max: int | None = None
    version_marks: list[tuple[int, int]] = field(default_factory=list)
    finish: str | None = None
    env_reward: float = 0.0
    started_ms: int = 0
    finished_ms: int = 0
    attempt: int = 0
    restarts: int = 0
    """Times the sample was started again from its prompt (``restart``)."""
    failed: tuple[str, str] | None = None
    """(error_type, reason) when its environment failed: the episode ends in a dead letter."""
    env_metadata: dict[str, str] = field(default_factory=dict)
    """Trajectory metadata its environment's steps set (``info["metadata"]``, e.g. ``tools``)."""

    rank: int | None = None
    """With ``rollout.overprovision``: the sample_index it is published under (its place among
    the first ``group_size`` samples of its group to finish); ``index`` stays its draw."""
    quorum: int = 0
    """``rollout.overprovision_tail = "train"``: the group's ``group_size`` (its quorum); the sample
    is published in a group of ``group_size`` + extra samples (``drawn``)."""
    drawn: int = 0
    """The samples drawn for its group, when ``quorum`` is set."""

    @property
    def tid(self) -> str:
        """The trajectory id it is published under."""
        return f"{self.prompt['group_id']}/{self.published_index}"

    @property
    def published_index(self) -> int:
        return self.index if self.rank is None else self.rank

    @property
    def draw_id(self) -> str:
        """Its id while it generates (engine requests): unique among the samples drawn for its
        group, over-provisioned ones included."""
        return f"{self.prompt['group_id']}/{self.index}"

    gen: int = 0
    """Ledger generation of the partition when the sample was admitted."""

    def start(self, tokenize, max_len: int) -> bool:
        """Begin the episode (again a no-op once started). False if there is no room to generate,
        or the environment's ``reset`` raised (``failed``)."""
        if self.started_ms:
            return True
        self.started_ms = now_ms()
        if self.env is not None:
            try:
                text = self.env.reset(self.prompt, self.index)
            except Exception as exc:  # this episode ends in a dead letter (``failed``); the others go on
                self.failed = ("env_error", f"env.reset: {type(exc).__name__}: {exc}")
                return False
            self.prompt_tokens = tokenize(text, not self.env.renders_chat)
            self.budget = min(self.budget, max_len - len(self.prompt_tokens))
        if self.budget <= 0:
            self.finish = "length"
            return False
        return True

    def request(self, temperature: float, stop_ids: frozenset[int], eos_id: int) -> GenRequest:
        """The engine request for the next (or the interrupted) model turn."""
        self.attempt += 1
        left = self.budget - len(self.tokens)
        if self.env is not None:
            left = min(left, self.max_turn_tokens - self.turn_tokens)
            stops = stop_ids | {eos_id}
        else:
            stops = frozenset({eos_id})
        return GenRequest(
            f"{self.draw_id}#{self.attempt}", self.prompt_tokens + self.tokens, max(1, left), temperature, stops
        )

    def add_output(self, out: GenOutput, version: int) -> None:
        """Record a (possibly partial) model turn generated at policy ``version``."""
        if out.tokens:
            if self.version_max != version:
                self.version_marks.append((len(self.tokens), version))
            self.version_min = version if self.version_min is None else min(self.version_min, version)
            self.version_max = version if self.version_max is None else max(self.version_max, version)
        self.tokens.extend(out.tokens)
        self.logprobs.extend(out.logprobs)
        self.mask.extend([1] * len(out.tokens))
        self.turn_tokens += len(out.tokens)

    def restart(self) -> int:
        """Discard the (single-turn) response so far, finished or not: the sample starts again from
        its prompt (``start`` then takes a new start time). Returns the number of tokens discarded."""
        if self.env is not None:
            raise ValueError("a multi-turn sample cannot restart: its environment has moved on")
        dropped = len(self.tokens)
        self.tokens, self.logprobs, self.mask, self.version_marks = [], [], [], []
        self.turns = self.turn_tokens = self.started_ms = self.finished_ms = 0
        self.finish = None
        self.version_min = self.version_max = None
        self.restarts += 1
        return dropped

    def end_turn(self, out: GenOutput, eos_id: int) -> bool:
        """After a completed model turn: True if the episode goes on (an env step is due)."""
        self.turns += 1
        self.turn_tokens = 0
        if self.env is None:
            self.finish = out.finish_reason
            return False
        if out.tokens and out.tokens[-1] == eos_id and self.env.eos_ends_episode:
            self.finish = "stop"
        elif len(self.tokens) >= self.budget:
            self.finish = "length"
        return self.finish is None

    def add_observation(self, res: StepResult, obs_tokens: list[int]) -> bool:
        """Append an environment observation; True if another model turn follows."""
        self.env_reward += res.reward
        room = self.budget - len(self.tokens)
        obs_tokens = obs_tokens[:room]
        self.tokens.extend(obs_tokens)
        self.logprobs.extend([0.0] * len(obs_tokens))
        self.mask.extend([0] * len(obs_tokens))
        if res.done:
            self.finish = "env_done"
        elif len(self.tokens) >= self.budget:
            self.finish = "length"
        elif self.turns >= self.max_turns:
            self.finish = "max_turns"
        return self.finish is None

    def trajectory(self, tokenizer, worker_id: str, engine: str, version: int) -> dict:
        self.finished_ms = self.finished_ms or now_ms()
        p = self.prompt
        meta = {}
        if self.version_marks:
            meta[VERSIONS_KEY] = format_version_marks(self.version_marks)
        if self.env is not None:
            meta[ENV_REWARD_KEY] = format_env_reward(self.env_reward)
        if self.rank is not None:
            meta[DRAW_KEY] = str(self.index)
        if self.quorum:
            meta[QUORUM_KEY] = str(self.quorum)
        meta.update(self.env_metadata)
        return {
            "trajectory_id": self.tid,
            "group_id": p["group_id"],
            "group_seq": p["group_seq"],
            "prompt_id": p["prompt_id"],
            "sample_index": self.published_index,
            "group_size": self.drawn if self.quorum else p["group_size"],
            "task": p["task"],
            "prompt_text": p["text"],
            "response_text": tokenizer.decode(self.tokens, skip_special_tokens=True),
            "prompt_tokens": codec.pack_i32(self.prompt_tokens),
            "response_tokens": codec.pack_i32(self.tokens),
            "logprobs": codec.pack_f32(self.logprobs),
            "loss_mask": codec.pack_u8(self.mask) if self.env is not None else b"",
            "finish_reason": self.finish or "stop",
            "version_min": version if self.version_min is None else self.version_min,
            "version_max": version if self.version_max is None else self.version_max,
            "reference": p.get("reference", ""),
            "worker_id": worker_id,
            "engine": engine,
            "num_turns": max(1, self.turns),
            "prompt_created_at_ms": p.get("created_at_ms", 0),
            "gen_started_at_ms": self.started_ms,
            "gen_finished_at_ms": self.finished_ms,
            "metadata": meta,
        }

    def dead_letter(self, rec: dict, role: str, worker_id: str) -> dict:
        """The DeadLetter of an episode whose environment failed (``failed``): its source is the
        prompt message, its value the episode so far (``rec``, encoded as a Trajectory), its key
        the group id, its ``trajectory_id`` header and ``reason`` name the trajectory."""
        error_type, reason = self.failed
        return {
            "source_topic": self.tp[0],
            "source_partition": self.tp[1],
            "source_offset": self.offset,
            "key": rec["group_id"].encode(),
            "value": codec.encode("Trajectory", rec),
            "headers": {"trajectory_id": self.tid.encode()},
            "error_type": error_type,
            "reason": f"trajectory {self.tid} (turn {self.turns}): {reason}",
            "role": role,
            "worker_id": worker_id,
            "failed_at_ms": now_ms(),
        }
