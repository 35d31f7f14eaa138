"""The ``deepspeed`` train engine: ZeRO stage 0-3 from config, one process or many (deepspeed
launcher / torchrun). Without a GPU it runs on the CPU with gloo (``DS_ACCELERATOR=cpu`` is set
when torch sees no CUDA); on GPUs it uses DeepSpeed's accelerator defaults (nccl).

Gradient accumulation is driven by the caller: every micro-batch but the last is marked as not a
boundary, then one ``step()``; the loss weights are global, so DeepSpeed's 1/GAS scaling is off.
The shm_comm op DeepSpeed JIT-builds on CPU is pre-built by scripts/build-deepspeed-ops.sh.
``dtype = "bfloat16"`` is DeepSpeed's bf16 mode: bf16 weights and activations for compute, float32
master weights and optimizer state inside ZeRO. LoRA (``trainer.lora``) wraps the model with PEFT
adapters before ``deepspeed.initialize``; only the adapters are optimised, checkpointed
(``exclude_frozen_parameters``) and published.
Not covered: ZeRO-3 construction under ``zero.Init`` for models larger than one rank's memory
(the model is loaded whole, then partitioned), and resuming with a different world size.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

from consumers.trainer.engines import lora
from consumers.trainer.engines.base import (
    TrainContext,
    TrainEngine,
    TrainStepResult,
    forward_loss,
    lr_lambda,
    merge_stats,
    token_logprobs,
)
from pipeline.log import kv
from pipeline.models import load_model
from pipeline.ports import free_port

log = logging.getLogger(__name__)


def _deep_merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v
    return base


def ds_config(trainer_cfg) -> dict:
    """The DeepSpeed JSON config generated from the trainer config."""
    e, o = trainer_cfg.engine, trainer_cfg.optim
    zero: dict = {"stage": e.zero_stage}
    if e.offload_optimizer and e.zero_stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu"}
    conf = {
        "train_micro_batch_size_per_gpu": trainer_cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": e.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _deep_merge(conf, dict(e.extra))


def _prefer_interpreter_ninja() -> None:
    """Put this interpreter's bin dir (the venv's pip ninja) first on PATH, as an activated venv
    and scripts/build-deepspeed-ops.sh do: ninja 1.11 and 1.13 hash build commands differently,
    so a JIT op pre-built by one is rebuilt (~60 s) by the other."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (Path(bin_dir) / "ninja").exists() and path[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *path])


class DeepSpeedEngine(TrainEngine):
    def __init__(self, config, ctx: TrainContext):
        trainer_cfg, model_dir = ctx.trainer, ctx.model_dir
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _prefer_interpreter_ninja()
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.config, self.cfg = config, trainer_cfg
        timeout = timedelta(seconds=trainer_cfg.dist_timeout_s)
        if "RANK" not in os.environ:  # one process without a launcher: a private one-rank group
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(auto_mpi_discovery=False, timeout=timeout)
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.manual_seed(trainer_cfg.seed)
        module = load_model(model_dir, dtype="float32", device="cpu")
        self.model_config = module.config
        if config.gradient_checkpointing:
            module.gradient_checkpointing_enable()
        self.lora = trainer_cfg.lora
        if self.lora is not None:
            module = lora.apply_lora(module, self.lora, config.gradient_checkpointing)
            self.weights_kind = "adapter"
        module.train()
        o = trainer_cfg.optim
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=trainer_cfg.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.ds_config = ds_config(trainer_cfg)
        decay = trainer_cfg.decay_steps()
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o, decay)),
            config=self.ds_config,
        )
        self.module = self.engine.module
        self.device = self.engine.device
        self.stage = config.zero_stage
        log.info(
            "deepspeed engine ready %s",
            kv(zero_stage=self.stage, world=self.world_size, device=self.device, dtype=config.dtype),
        )

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def train_step(self, micro_batches, loss_fn, capture_grads: bool = False) -> TrainStepResult:
        from deepspeed.utils import safe_get_full_grad

        total, stats = 0.0, {}
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            mb = mb.to(self.device)
            self.engine.set_gradient_accumulation_boundary(i == last)
            loss, st = forward_loss(self.engine, mb, loss_fn)
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"non-finite loss {float(loss)} in micro-batch {i} ({mb.ids[:3]}...)")
            # DeepSpeed averages gradients over ranks; the loss weights are global, so undo the mean.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            total += float(loss.detach())
            merge_stats(stats, st)
        grads = None
        if capture_grads:
            grads = {}
            for n, p in self.module.named_parameters():
                g = safe_get_full_grad(p)
                if g is not None:
                    grads[n] = g.detach().float().to("cpu", copy=True)
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        grad_norm = float(gn) if gn is not None else float("nan")
        return TrainStepResult(loss=total, grad_norm=grad_norm, lr=self.lr, stats=stats, grads=grads)

    @torch.no_grad()
    def compute_logprobs(self, micro_batches) -> list:
        return [token_logprobs(self.engine, mb.to(self.device)).cpu() for mb in micro_batches]

    def state_dict(self) -> dict | None:
        if self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                sd = self._cpu_state() if self.rank == 0 else None
            return sd
        return self._cpu_state() if self.rank == 0 else None

    def _cpu_state(self) -> dict:
        if self.lora is not None:
            return {k: v.float() for k, v in lora.adapter_state(self.module).items()}
        return {k: v.detach().float().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def adapter_config(self) -> dict | None:
        return lora.adapter_config(self.module) if self.lora is not None else None

    def save(self, path: Path) -> None:
        path = Path(path)
        self.engine.save_checkpoint(
            str(path.parent), tag=path.name, save_latest=False, exclude_frozen_parameters=self.lora is not None
        )

    def load(self, path: Path) -> None:
        path = Path(path)
        load_path, _ = self.engine.load_checkpoint(
            str(path.parent),
            tag=path.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=self.lora is None,
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint at {path}")
