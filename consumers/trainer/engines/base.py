"""The train-engine interface and what every engine shares: per-token logprobs (and entropies) from
a causal LM on padded or packed micro-batches, the learning-rate schedule (warmup, then constant,
linear or cosine decay), and small torch.distributed helpers (rank/world from the launcher's
environment, object broadcast, sums across ranks).

An engine owns the trained model and its optimizer. It does not know about Kafka, versions or
losses: ``train_step`` takes micro-batches and a ``loss_fn(logp, mb) -> (loss, stats)``
(``losses.LossFn``, which declares ``needs_entropy``: then it is called with ``entropy=`` too). Every
engine is built as ``Engine(config, ctx: TrainContext)``: its own section (``trainer.engine``)
and the trainer's settings it needs (learning rate, optimizer, seed, collective timeout).
"""

from __future__ import annotations

import contextlib
import math
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
class TrainStepResult:
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


def close_dist(world: int) -> None:
    """Destroy the process groups of a multi-process run, if there are any. Every rank calls it once
    its last collective is done (what a multi-rank program should do before it exits). It does not
    stop gloo's worker threads while the model still holds the group, so a multi-rank command also
    ends without interpreter teardown (``Trainer.teardown_hazards``)."""
    if world <= 1:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def merge_stats(into: dict, new: dict) -> None:
    for k, (s, n) in new.items():
        a, b = into.get(k, (0.0, 0.0))
        into[k] = (a + s, b + n)


def warmup_lambda(warmup_steps: int):
    """LambdaLR factor: linear warmup over ``warmup_steps`` optimizer steps, then 1."""
    if warmup_steps <= 0:
        return lambda step: 1.0
    return lambda step: min(1.0, (step + 1) / warmup_steps)


def lr_lambda(optim, decay_steps: int):
    """LambdaLR factor of optimizer step ``step`` (0-based) under ``optim`` (an ``OptimConfig``):
    ``(step + 1) / W`` during ``W = warmup_steps`` steps of warmup, then with
    ``p = clamp((step - W) / (decay_steps - W), 0, 1)`` and floor ``m = min_lr_ratio``:
    constant 1; linear ``m + (1 - m)(1 - p)``; cosine ``m + (1 - m)(1 + cos(pi p)) / 2``."""
    w, kind, floor = optim.warmup_steps, optim.lr_schedule, optim.min_lr_ratio
    span = max(1, decay_steps - w)

    def factor(step: int) -> float:
        if w > 0 and step < w:
            return (step + 1) / w
        if kind == "constant":
            return 1.0
        p = min(1.0, max(0.0, (step - w) / span))
        if kind == "linear":
            return floor + (1.0 - floor) * (1.0 - p)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))

    return factor


def token_logprobs(model, mb, entropy: bool = False, autocast_dtype=None):
    """log pi(target_t | tokens_<=t) for every position of ``mb`` ([b, T-1], float32); with
    ``entropy`` also the entropy of each position's next-token distribution (with gradient).

    Padded micro-batches pass ``attention_mask``; packed ones pass ``position_ids`` and no mask,
    which HF models turn into a block-causal mask (or varlen flash-attention). Only the model's
    forward runs under ``autocast_dtype`` (mixed precision); the log-softmax math is float32.
    Uses ``gather - logsumexp`` on raw logits (no full log_softmax tensor kept)."""
    import torch

    kw = {"input_ids": mb.input_ids, "use_cache": False}
    if mb.position_ids is not None:
        kw["position_ids"] = mb.position_ids
    else:
        kw["attention_mask"] = mb.attention_mask
    # Only positions from the first trained one on need logits: the vocabulary projection and its
    # log-softmax are a large share of a small model's step (SmolLM2-135M: a 49k vocabulary), and the
    # prompt's positions are never trained. Earlier positions get logprob 0 (masked by token_mask).
    width = mb.targets.shape[1]
    first = _first_trained(mb.token_mask)
    if first > 0:
        kw["logits_to_keep"] = width + 1 - first
    device_type = mb.input_ids.device.type
    ctx = torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with ctx:
        out = model(**kw)
    logits = out.logits[:, :-1].float()
    picked = logits.gather(-1, mb.targets[:, first:].unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    logp = _pad_front(picked - lse, first)
    if not entropy:
        return logp
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, _pad_front(ent, first)


def untied(state: dict) -> dict:
    """``state`` with every tensor that shares storage with an earlier one left out (a tied output
    embedding is the input embedding: SmolLM2's 113 MB ``lm_head.weight`` would be written twice).
    Loaders re-tie it (``tie_weights``; vLLM and HF skip the tied name)."""
    seen, out = set(), {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v
    return out


def _first_trained(token_mask) -> int:
    """Index of the first shifted position any row trains on (0 if none)."""
    cols = token_mask.detach().abs().sum(0).nonzero()
    return int(cols[0]) if len(cols) else 0


def _pad_front(t, n: int):
    import torch

    if n == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], n), t], dim=1)


def forward_loss(model, mb, loss_fn, autocast_dtype=None):
    """Logprobs (and entropies when ``loss_fn.needs_entropy``) of ``mb``, then ``loss_fn``."""
    if loss_fn.needs_entropy:
        logp, ent = token_logprobs(model, mb, entropy=True, autocast_dtype=autocast_dtype)
        return loss_fn(logp, mb, entropy=ent)
    return loss_fn(token_logprobs(model, mb, autocast_dtype=autocast_dtype), mb)


class TrainEngine(ABC):
    """One interface for every engine. All methods are collective under data parallelism: every
    rank calls them in the same order. Subclasses take ``(config, ctx: TrainContext)``.

    What an engine can do and what the trainer reads from it are declared here, never probed:
    ``multi_process``, ``weights_kind``, ``autocast``, ``model_config`` (and from it
    ``name_or_path`` and ``pad_id``), ``rank``/``world_size``/``device``."""

    multi_process: bool = True
    """Capability (of the class): runs under torchrun / the deepspeed launcher with several ranks."""
    weights_kind: str = "full"
    """What ``state_dict`` returns: ``full`` weights, or a LoRA ``adapter`` (then ``adapter_config``)."""
    autocast: Any = None
    """The torch dtype the model's forward runs under (mixed precision, ``torch.autocast``), or
    None; the trainer runs the reference model's forward (KL penalty) under it too."""
    config: Any = None
    """The engine's own config section (``trainer.engine``)."""
    model_config: Any = None
    """The Hugging Face config of the trained model (``PretrainedConfig``: vocabulary size, context
    length, pad token, attention implementation, the directory it was loaded from); every engine
    sets it when it loads the model."""
    rank: int = 0
    world_size: int = 1
    device = "cpu"

    @abstractmethod
    def train_step(self, micro_batches: list, loss_fn, capture_grads: bool = False) -> TrainStepResult:
        """One optimizer step over this rank's ``micro_batches`` (gradients accumulate)."""

    @abstractmethod
    def compute_logprobs(self, micro_batches: list) -> list:
        """Per-token logprobs of the current weights, without gradients (CPU tensors)."""

    @abstractmethod
    def state_dict(self) -> dict | None:
        """The weights to publish as CPU tensors, on rank 0 (None elsewhere): the full model with
        the HF model's names, or (``weights_kind == "adapter"``) the LoRA adapter with PEFT's names."""

    def adapter_config(self) -> dict | None:
        """PEFT's adapter config (``adapter_config.json``) when ``weights_kind == "adapter"``."""
        return None

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
    def name_or_path(self) -> str:
        """The HF directory the model was loaded from (``model_config.name_or_path``)."""
        return str(self.model_config.name_or_path or "")

    @property
    def pad_id(self) -> int:
        return int(self.model_config.pad_token_id or 0)
