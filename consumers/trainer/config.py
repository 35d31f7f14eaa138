"""Configuration of the trainer: group assembly, the train engine (a union on ``type``), the
optimizer, advantages, the loss, checkpoints and weight publishing.

Only declarations and bounds live here; the formulas are in ``advantages.py``/``losses.py`` and
docs/losses.md. Values several roles share (k, n, G) are in ``pipeline.config.RLConfig``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pipeline.config import StrictModel


class TorchEngineConfig(StrictModel):
    """Plain PyTorch: one process, or DDP when launched by torchrun (WORLD_SIZE > 1)."""

    type: Literal["torch"] = "torch"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda (this rank's LOCAL_RANK) when available, else cpu."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained model (optimizer math follows it)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, ~30% more compute)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend under torchrun; auto: nccl on cuda, gloo on cpu."""


class DeepSpeedEngineConfig(StrictModel):
    """DeepSpeed ZeRO. On a machine without GPUs it runs on the CPU with gloo (DS_ACCELERATOR=cpu)."""

    type: Literal["deepspeed"] = "deepspeed"
    zero_stage: int = Field(2, ge=0, le=3)
    """ZeRO stage: 0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """bfloat16 turns on DeepSpeed's bf16 mode (fp32 master weights kept by ZeRO)."""
    offload_optimizer: bool = False
    """ZeRO-Offload of optimizer states to CPU memory (stage >= 1)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Merged last into the generated DeepSpeed config (e.g. {"zero_optimization": {"overlap_comm": true}})."""


class SimEngineConfig(StrictModel):
    """A load generator, NOT a trainer: sleeps ``token_cost_s`` per token of the step's samples and
    leaves the weights unchanged. The rest of the trainer (Kafka, staleness gate, checkpoints,
    WeightUpdates) is real; benchmarks use it to measure the pipeline's scheduling (rlstream/bench/async_sync.py)."""

    type: Literal["sim"] = "sim"
    token_cost_s: float = Field(1e-4, ge=0, le=1.0)
    """Wall seconds per (prompt + response) token of every trained sample."""


EngineConfig = Annotated[TorchEngineConfig | DeepSpeedEngineConfig | SimEngineConfig, Field(discriminator="type")]


class OptimConfig(StrictModel):
    """AdamW with linear warmup, then a constant learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0, le=1e-2)
    """Adam epsilon."""
    weight_decay: float = Field(0.0, ge=0, le=1.0)
    """Decoupled weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to ``trainer.lr``."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping."""

    @model_validator(mode="after")
    def _betas(self):
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError("betas must be in [0, 1)")
        return self


class AdvantageConfig(StrictModel):
    """How a group's rewards become per-sample advantages (docs/losses.md)."""

    estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """grpo: (r - mean)/(std + eps); dr_grpo: r - mean; rloo: r - mean of the others."""
    eps: float = Field(1e-6, gt=0, le=1.0)
    """grpo: added to the group's std."""
    std_unbiased: bool = True
    """grpo: sample std (n - 1), as TRL and verl do; false: population std (n)."""


class LossConfig(StrictModel):
    """The policy loss (docs/losses.md has every formula). ``ratio`` is pi_theta / pi_behaviour."""

    type: Literal["ppo_clip", "tis", "decoupled_ppo", "cispo"] = "ppo_clip"
    """ppo_clip, tis (truncated importance sampling), decoupled_ppo (AReaL), cispo (MiniMax-M1)."""
    clip_eps_low: float = Field(0.2, ge=0, le=1.0)
    """ppo_clip/decoupled_ppo: the ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.2, ge=0, le=10.0)
    """ppo_clip/decoupled_ppo: clipped above at 1 + clip_eps_high (DAPO's clip-higher uses 0.28)."""
    tis_cap: float = Field(2.0, gt=0)
    """tis: the importance weight min(ratio, tis_cap) (detached) multiplies A * log pi_theta."""
    behav_weight_cap: float | None = Field(5.0, gt=0)
    """decoupled_ppo: cap of the behaviour weight pi_prox / pi_behaviour; None: uncapped."""
    cispo_eps_low: float = Field(1.0, ge=0, le=1.0)
    """cispo: the detached IS weight is clipped below at 1 - cispo_eps_low (1.0: no lower clip)."""
    cispo_eps_high: float = Field(4.0, ge=0)
    """cispo: clipped above at 1 + cispo_eps_high."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How token losses of one optimizer step become a scalar (docs/losses.md)."""
    norm_tokens: int | None = Field(None, ge=1)
    """seq-mean-token-sum-norm: the constant token count L (Dr. GRPO); None: the longest response of the step."""
    kl_coef: float = Field(0.0, ge=0)
    """beta of the KL penalty to the frozen reference (version-0) model; 0 disables it and its forward pass."""
    kl_estimator: Literal["k3"] = "k3"
    """k3 = exp(ref - logp) - (ref - logp) - 1, per token (Schulman's unbiased, non-negative estimator)."""


class TrainerConfig(StrictModel):
    group_id: str = "rlstream-trainer"
    """Consumer group the trainer commits its consumed offsets to (for lag visibility only:
    resume uses the offsets in the trainer checkpoint)."""
    trainer_id: str = "trainer-0"
    """Stable name of this trainer in WeightUpdates, metrics and client ids."""
    lr: float = Field(1e-4, gt=0, le=1.0)
    """Learning rate (after warmup)."""
    engine: EngineConfig = TorchEngineConfig()
    """The train engine: ``type = "torch"``, ``"deepspeed"``, or ``"sim"`` (a load generator for benchmarks)."""
    optim: OptimConfig = OptimConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    micro_batch_size: int = Field(8, ge=1, le=4096)
    """Samples per forward/backward; gradients accumulate over micro-batches."""
    minibatches: int = Field(1, ge=1, le=64)
    """Optimizer steps per trainer step: the G groups' samples are split into this many
    minibatches, each used by exactly one optimizer step. The version advances once per trainer step."""
    group_timeout_s: float = Field(300.0, gt=0)
    """A group still incomplete this long after its first sample arrived is closed."""
    incomplete_groups: Literal["drop", "train"] = "drop"
    """What a closed incomplete group does: drop (counted, no gradient) or train on the samples it has.
    Either way it counts towards the step's G (pipeline.control)."""
    publish_every: int = Field(1, ge=1, le=1000)
    """Checkpoint and publish weights every this many trainer steps. The version counts trainer steps,
    so notices skip versions when > 1; must be <= rl.max_staleness + 1 or admission would deadlock."""
    keep_weight_versions: int = Field(3, ge=1)
    """Published weight versions kept in the store (older ones are deleted)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Trainer checkpoints (model + optimizer + offsets) kept in the checkpoint dir."""
    checkpoint_dir: Path | None = None
    """Trainer checkpoints and the steps log; None: ``<run_dir>/trainer``."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many trainer steps in total (counting steps before a restart); 0: run forever."""
    poll_timeout_s: float = Field(0.5, gt=0, le=60)
    """Longest wait for records in one poll."""
    closed_group_memory: int = Field(20_000, ge=0)
    """Remember this many trained group ids (kept in the checkpoint) so a late sample of one is dropped."""
    metrics_interval_s: float = Field(5.0, gt=0)
    """Periodic MetricEvent interval (one is also sent after every trainer step)."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus /metrics on this port; 0: off."""
    seed: int = 0
    """Seeds torch (dropout-free models are deterministic anyway) and the minibatch split."""
    dist_timeout_s: float = Field(1800.0, gt=0)
    """torch.distributed collective timeout under torchrun/deepspeed launcher."""
