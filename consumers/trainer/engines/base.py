"""The train-engine interface and what every engine shares: per-token logprobs from a causal LM,
the learning-rate schedule, and small torch.distributed helpers (rank/world from the launcher's
environment, object broadcast, sums across ranks).

An engine owns the trained model and its optimizer. It does not know about Kafka, versions or
losses: ``train_step`` takes micro-batches and a ``loss_fn(logp, mb) -> (loss, stats)``. Every
engine is built as ``Engine(config, ctx: TrainContext)``: its own section (``trainer.engine``)
and the trainer's settings it needs (learning rate, optimizer, seed, collective timeout).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainContext:
    """What every train engine is given besides its config section."""

    model_dir: Path
    """The model to train (HF layout)."""
    trainer: Any
    """The trainer's config section (lr, optim, seed, dist_timeout_s, ...)."""


@dataclass
class StepResult:
    """What one optimizer step did on this rank."""

    loss: float
    """Sum of this rank's micro-batch losses (sum over ranks = the step loss)."""
    grad_norm: float
    lr: float
    stats: dict[str, tuple[float, float]] = field(default_factory=dict)
    """{name: (sum, count)} over this rank's trained tokens."""
    skipped: bool = False
    """True if the update was skipped (non-finite gradient norm)."""
    grads: dict | None = None
    """Full gradients by parameter name, before the update (only with ``capture_grads``)."""


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) set by torchrun / the deepspeed launcher; (0, 1, 0) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def broadcast_object(obj, world: int):
    """``obj`` from rank 0 on every rank (identity when there is one rank)."""
    if world <= 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sums(values: list[float], world: int, device="cpu") -> list[float]:
    if world <= 1:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def merge_stats(into: dict, new: dict) -> None:
    for k, (s, n) in new.items():
        a, b = into.get(k, (0.0, 0.0))
        into[k] = (a + s, b + n)


def warmup_lambda(warmup_steps: int):
    """LambdaLR factor: linear warmup over ``warmup_steps`` optimizer steps, then 1."""
    if warmup_steps <= 0:
        return lambda step: 1.0
    return lambda step: min(1.0, (step + 1) / warmup_steps)


def token_logprobs(model, mb):
    """log pi(target_t | tokens_<=t) for every position of ``mb`` ([b, T-1], float32).

    Uses ``gather - logsumexp`` on raw logits (no full log_softmax tensor kept)."""
    import torch

    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
    logits = out.logits[:, :-1].float()
    picked = logits.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


class TrainEngine(ABC):
    """One interface for every engine. All methods are collective under data parallelism: every
    rank calls them in the same order. Subclasses take ``(config, ctx: TrainContext)``."""

    multi_process: bool = True
    """Capability: runs under torchrun / the deepspeed launcher with several ranks."""
    rank: int = 0
    world_size: int = 1
    device = "cpu"

    @abstractmethod
    def train_step(self, micro_batches: list, loss_fn, capture_grads: bool = False) -> StepResult:
        """One optimizer step over this rank's ``micro_batches`` (gradients accumulate)."""

    @abstractmethod
    def compute_logprobs(self, micro_batches: list) -> list:
        """Per-token logprobs of the current weights, without gradients (CPU tensors)."""

    @abstractmethod
    def state_dict(self) -> dict | None:
        """Full weights as CPU tensors with the HF model's names, on rank 0 (None elsewhere)."""

    @abstractmethod
    def save(self, path: Path) -> None:
        """Write model, optimizer and scheduler state under the directory ``path``."""

    @abstractmethod
    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote."""

    @property
    @abstractmethod
    def lr(self) -> float: ...

    @property
    def pad_id(self) -> int:
        return int(getattr(self.config, "pad_token_id", None) or 0)
