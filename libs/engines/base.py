"""The small interface every rollout engine implements, and the context it is built with.

An engine generates token ids with behaviour logprobs for requests that are already tokenized,
one request per sample (queue scheduling): ``submit`` a request, call ``step`` repeatedly to
advance generation and collect the requests that finished, ``abort`` in-flight requests (their
partial outputs come back so they can resume as partial rollouts), and ``load_weights`` from a
verified WeightUpdate at a safe point (no request in flight).

Logprobs are those of the distribution the token was sampled from: ``log_softmax(raw_logits / T)``
over the whole vocabulary (no top-k/top-p/penalties), ``T = 1`` for greedy decoding.

Every engine is built as ``Engine(config, ctx)``: its own config section (``rollout.engine``) and
an ``EngineContext``. What it can do is declared as class attributes (``max_model_len``,
``step_wait_s``, ``weight_formats``, ``weight_kinds``), which the worker reads instead of checking
names: a WeightUpdate of a format or kind (``full`` weights or a LoRA ``adapter``) the engine does
not declare is refused loudly by ``producers.weights``. The registry of engines is
``libs.engines.ENGINES``.

What this is not: a tokenizer or a Kafka client. The rollout worker owns prompts and commits;
engines never see a message. Heavy libraries are imported only by the engine modules.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.checkpoint import FORMAT, SHARDED_FORMAT, read_weights
from pipeline.errors import RlstreamError
from pipeline.records import update_kind


class EngineHTTPError(RlstreamError):
    """The completions server answered with an error, or the connection failed past the retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
        """The HTTP status the server answered (None: no answer)."""


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


@dataclass
class EngineContext:
    """What every rollout engine is given besides its config section."""

    model_dir: Path
    """The version-0 model (HF layout: config, weights, tokenizer)."""
    tokenizer: Any
    """The policy's tokenizer (already loaded)."""
    worker_id: str = ""
    """The rollout worker's id (seeds samplers, names requests)."""
    max_inflight: int = 32
    """Most requests the worker keeps in the engine at once."""


class Engine(ABC):
    """Base of every rollout engine. Subclasses take ``(config, ctx: EngineContext)``."""

    name = "base"
    """Label in trajectories and metrics."""
    max_model_len: int = 1 << 30
    """Longest context + response the engine can hold (set by the engine once loaded)."""
    step_wait_s: float = 0.0
    """How long ``step`` should wait for results when the engine waits on something else (HTTP)."""
    weight_formats: frozenset[str] = frozenset({FORMAT, SHARDED_FORMAT})
    """WeightUpdate formats ``load_weights`` accepts (one ``model.safetensors``, or HF's sharded
    layout whose index the notice names: ``pipeline.checkpoint``); the worker refuses others, loudly."""
    weight_kinds: frozenset[str] = frozenset({"full"})
    """WeightUpdate kinds ``load_weights`` accepts: ``full`` weights and/or LoRA ``adapter`` s
    (``libs.engines.adapters``); the worker refuses others, loudly."""

    def __init__(self, config=None, ctx: EngineContext | None = None):
        self.config, self.ctx = config, ctx
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
        """Fetch and verify the checkpoint a WeightUpdate names (sha256; every shard against the
        index); runs in a background thread while generation goes on, so an engine should do here
        all it can (reading, verifying, converting, staging) and leave ``load_weights`` only the swap.
        Returns what ``load_weights`` needs: a state dict for full weights (shards read in parallel:
        ``pipeline.checkpoint.iter_weights``), a ``PreparedAdapter`` (checked against this worker's
        base model) for an adapter."""
        if update_kind(update) == "adapter":
            from libs.engines.adapters import prepare_adapter

            return prepare_adapter(update, self.ctx.model_dir)
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
