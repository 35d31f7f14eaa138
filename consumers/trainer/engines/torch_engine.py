"""The ``torch`` train engine: AdamW on a plain HF model in one process, or DistributedDataParallel
when launched by torchrun (WORLD_SIZE > 1; gloo on CPU, nccl on GPUs).

Mixed precision (``dtype = "bfloat16"``): the model's weights stay float32 (the master copy), the
forward and backward run under ``torch.autocast(bfloat16)``, gradients and AdamW's moments are
float32, and the published weights are float32 (rollout engines cast them to their own dtype).
LoRA (``trainer.lora``): PEFT adapters on the frozen base; the optimizer holds only the adapters,
``state_dict`` is the adapter (published with ``kind = "adapter"``), and the engine checkpoint
holds the adapters and optimizer only.

Not sharded: every rank holds the full model and optimizer state (use ``deepspeed`` for ZeRO).
"""

from __future__ import annotations

import contextlib
import logging
import math
from datetime import timedelta
from pathlib import Path

import torch

from consumers.trainer.engines import lora
from consumers.trainer.engines.base import (
    TrainContext,
    TrainEngine,
    TrainStepResult,
    dist_env,
    forward_loss,
    lr_lambda,
    merge_stats,
    token_logprobs,
    untied,
)
from pipeline.log import kv
from pipeline.models import load_model, resolve_dtype

log = logging.getLogger(__name__)


class TorchEngine(TrainEngine):
    def __init__(self, config, ctx: TrainContext):
        ecfg, trainer_cfg, model_dir = config, ctx.trainer, ctx.model_dir
        self.config, self.cfg = ecfg, trainer_cfg
        self.rank, self.world_size, local = dist_env()
        use_cuda = ecfg.device == "cuda" or (ecfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        if self.world_size > 1 and not torch.distributed.is_initialized():
            backend = ecfg.backend if ecfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
            torch.distributed.init_process_group(backend, timeout=timedelta(seconds=trainer_cfg.dist_timeout_s))
        if ecfg.threads:
            torch.set_num_threads(ecfg.threads)
        torch.manual_seed(trainer_cfg.seed)
        self.dtype = resolve_dtype(ecfg.dtype, self.device)
        self.autocast = torch.bfloat16 if self.dtype == "bfloat16" else None
        self.module = load_model(model_dir, dtype="float32", device=str(self.device))  # float32 masters
        self.model_config = self.module.config
        if ecfg.gradient_checkpointing:
            self.module.gradient_checkpointing_enable()
        self.lora = trainer_cfg.lora
        if self.lora is not None:
            self.module = lora.apply_lora(self.module, self.lora, ecfg.gradient_checkpointing)
            self.weights_kind = "adapter"
        self.module.train()
        self.model = self.module
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.module, device_ids=[local] if use_cuda else None)
        o = trainer_cfg.optim
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=trainer_cfg.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o, trainer_cfg.decay_steps()))
        log.info(
            "torch engine ready %s",
            kv(device=self.device, world=self.world_size, dtype=self.dtype, lora=self.lora is not None,
               trainable=sum(p.numel() for p in self.params)),
        )  # fmt: skip

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, micro_batches, loss_fn, capture_grads: bool = False) -> TrainStepResult:
        self.optimizer.zero_grad(set_to_none=True)
        total, stats = 0.0, {}
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            mb = mb.to(self.device)
            no_sync = self.world_size > 1 and i < last
            with self.model.no_sync() if no_sync else contextlib.nullcontext():
                loss, st = forward_loss(self.model, mb, loss_fn, self.autocast)
                # DDP averages gradients over ranks; the loss weights are global, so undo the mean.
                (loss * self.world_size).backward()
            total += float(loss.detach())
            merge_stats(stats, st)
        grads = None
        if capture_grads:  # before clipping, like DeepSpeed's (which clips inside step())
            grads = {
                n: p.grad.detach().to("cpu", copy=True) for n, p in self.module.named_parameters() if p.grad is not None
            }
        clip = self.cfg.optim.grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else math.inf))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.error("non-finite gradient norm: update skipped %s", kv(grad_norm=grad_norm))
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
        return TrainStepResult(loss=total, grad_norm=grad_norm, lr=self.lr, stats=stats, skipped=skipped, grads=grads)

    @torch.no_grad()
    def compute_logprobs(self, micro_batches) -> list:
        return [
            token_logprobs(self.module, mb.to(self.device), autocast_dtype=self.autocast).cpu() for mb in micro_batches
        ]

    def state_dict(self) -> dict | None:
        if self.rank != 0:
            return None
        if self.lora is not None:
            return lora.adapter_state(self.module)
        return {k: v.detach().to("cpu", copy=True) for k, v in untied(self.module.state_dict()).items()}

    def adapter_config(self) -> dict | None:
        return lora.adapter_config(self.module) if self.lora is not None else None

    def save(self, path: Path) -> None:
        if self.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "model": lora.trainable_state(self.module) if self.lora is not None else self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        tmp = path / "engine.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(path / "engine.pt")

    def load(self, path: Path) -> None:
        state = torch.load(Path(path) / "engine.pt", map_location=self.device, weights_only=True)
        if self.lora is not None:
            lora.load_trainable(self.module, state["model"])
        else:
            self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
