"""The small interface every rollout engine implements, and the engine factory.

An engine generates token ids with behaviour logprobs for requests that are already tokenized,
one request per sample (queue scheduling): ``submit`` a request, call ``step`` repeatedly to
advance generation and collect the requests that finished, ``abort`` in-flight requests (their
partial outputs come back so they can resume as partial rollouts), and ``load_weights`` from a
verified WeightUpdate at a safe point (no request in flight).

Logprobs are those of the distribution the token was sampled from: ``log_softmax(raw_logits / T)``
over the whole vocabulary (no top-k/top-p/penalties), ``T = 1`` for greedy decoding.

What this is not: a tokenizer or a Kafka client. The rollout worker owns prompts and commits;
engines never see a message. Heavy libraries are imported only by the engine modules.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pipeline.checkpoint import read_weights


@dataclass
class GenRequest:
    rid: str
    """Unique id of this request (the worker uses trajectory_id#attempt)."""
    context: list[int]
    """Token ids to condition on: the prompt plus everything generated or observed so far."""
    max_new_tokens: int
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 = greedy."""
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    """Token ids that end the request (EOS included by the caller); the stop token is kept."""


@dataclass
class GenOutput:
    rid: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    """stop | length | abort"""


class Engine(ABC):
    """Base of the hf, vllm and openai engines."""

    name = "base"

    def __init__(self):
        self.version = 0
        """Policy version of the weights the engine holds."""

    @abstractmethod
    def submit(self, req: GenRequest) -> None:
        """Queue a request; it starts as soon as the engine has room."""

    @abstractmethod
    def step(self, timeout: float = 0.0) -> list[GenOutput]:
        """Advance generation a little; return requests that finished (stop or length).
        ``timeout`` bounds how long to wait when the engine itself is waiting (e.g. on HTTP)."""

    @abstractmethod
    def abort(self, rids: list[str] | None = None) -> list[GenOutput]:
        """Stop requests (all if None); returns their partial outputs with finish_reason 'abort'."""

    @abstractmethod
    def inflight(self) -> int:
        """Requests submitted and not yet returned by step/abort."""

    def prepare_weights(self, update: dict):
        """Fetch and verify the checkpoint a WeightUpdate names (sha256); may run in a background
        thread while generation goes on. Returns what ``load_weights`` needs."""
        return read_weights(update["uri"], update["sha256"])

    @abstractmethod
    def load_weights(self, update: dict, prepared) -> None:
        """Swap in the prepared weights. Called with nothing in flight."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine's resources."""

    def generate(self, reqs: list[GenRequest], timeout: float = 600.0) -> list[GenOutput]:
        """Blocking convenience: run ``reqs`` to completion, outputs in request order."""
        for r in reqs:
            self.submit(r)
        want = {r.rid for r in reqs}
        done: dict[str, GenOutput] = {}
        deadline = time.monotonic() + timeout
        while want - done.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(f"generate: {len(want - done.keys())} request(s) unfinished after {timeout}s")
            for out in self.step(0.05):
                done[out.rid] = out
        return [done[r.rid] for r in reqs]


def build_engine(engine_cfg, model_dir, tokenizer, worker_id: str = "") -> Engine:
    """The engine that ``engine_cfg.type`` names, loading the version-0 model from ``model_dir``."""
    if engine_cfg.type == "hf":
        from producers.engines.hf import HFEngine

        return HFEngine(engine_cfg, model_dir, tokenizer, worker_id)
    if engine_cfg.type == "vllm":
        from producers.engines.vllm import VLLMEngine

        return VLLMEngine(engine_cfg, model_dir, tokenizer)
    if engine_cfg.type == "openai":
        from producers.engines.openai import OpenAIEngine

        return OpenAIEngine(engine_cfg, tokenizer)
    if engine_cfg.type == "sim":
        from producers.engines.sim import SimEngine

        return SimEngine(engine_cfg, tokenizer, worker_id)
    raise ValueError(f"unknown engine type {engine_cfg.type!r}")
