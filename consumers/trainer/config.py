"""Configuration of the trainer: group assembly, dynamic sampling, the train engine (a union on
``type``), LoRA, the optimizer and its learning-rate schedule, advantages, the loss, micro-batching
by tokens and packing, overlong filtering, checkpoints and weight publishing.

Only declarations and bounds live here; the advantage and loss sections (a union per built-in,
with the deprecated flat keys) are in ``loss_config.py``, the formulas in ``advantages.py``/``losses.py``
and docs/reference/losses.md. Values several roles share (k, n, G) are in ``pipeline.config.RLConfig``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from consumers.trainer.loss_config import AdvantageConfig, GrpoAdvantageConfig, LossConfig, PPOClipLossConfig
from pipeline.config import StrictModel, plugin_union
from pipeline.topology import DEFAULT as DEFAULT_IDENTITY


class TorchEngineConfig(StrictModel):
    """Plain PyTorch: one process, or DDP when launched by torchrun (WORLD_SIZE > 1)."""

    type: Literal["torch"] = "torch"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda (this rank's LOCAL_RANK) when available, else cpu."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Compute dtype. bfloat16: mixed precision, i.e. forward and backward under bf16 autocast while
    the weights (the master copy), gradients and AdamW state stay float32; published weights are float32.
    auto: bfloat16 where the device computes it natively (a GPU with bf16, a CPU with AVX512-BF16 or
    AMX), else float32 (bf16 is emulated, several times slower, on an AVX2-only CPU)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, ~30% more compute)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend under torchrun; auto: nccl on cuda, gloo on cpu."""
    threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads on the CPU (0 = torch's default, one per core); set it when rollout
    workers share the machine, so the processes do not oversubscribe its cores."""


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


class SimTrainEngineConfig(StrictModel):
    """A load generator, NOT a trainer: sleeps ``token_cost_s`` per token of the step's samples and
    leaves the weights unchanged. The rest of the trainer (Kafka, staleness gate, checkpoints,
    WeightUpdates) is real; benchmarks use it to measure the pipeline's scheduling (rlstream/dev/bench/async_sync.py)."""

    type: Literal["sim"] = "sim"
    token_cost_s: float = Field(1e-4, ge=0, le=1.0)
    """Wall seconds per (prompt + response) token of every trained sample."""


EngineConfig = plugin_union(TorchEngineConfig, DeepSpeedEngineConfig, SimTrainEngineConfig)


class OptimConfig(StrictModel):
    """AdamW with linear warmup, then a constant, linearly or cosine decaying learning rate."""

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
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: constant, or linear / cosine decay from ``trainer.lr`` to ``min_lr_ratio * lr``
    at optimizer step ``decay_steps`` (then constant at the floor)."""
    decay_steps: int | None = Field(None, ge=1)
    """Optimizer step at which the decay reaches its floor (counting warmup steps); None: the run's
    optimizer steps, ``trainer.max_steps * trainer.minibatches`` (then ``max_steps`` must be set)."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the decay as a fraction of ``trainer.lr``."""

    @model_validator(mode="after")
    def _betas(self):
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError("betas must be in [0, 1)")
        return self


class LoraConfig(StrictModel):
    """LoRA (PEFT): train low-rank adapters on a frozen base; every published version is the
    adapter alone (``WeightUpdate.kind = "adapter"``), applied by the rollout engines."""

    rank: int = Field(8, ge=1, le=4096)
    """r: the rank of every adapter's A (r x in) and B (out x r) matrices."""
    alpha: float = Field(16.0, gt=0, le=65536)
    """lora_alpha: the update is scaled by alpha / r (alpha / sqrt(r) with ``rslora``)."""
    dropout: float = Field(0.0, ge=0, lt=1.0)
    """Dropout on the adapter's input while training (the rollout side applies none)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """Names (last path component) of the linear layers that get adapters; Llama/Qwen-style defaults."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r."""


class TrainerConfig(StrictModel):
    group_id: str = DEFAULT_IDENTITY.group("trainer")
    """Consumer group the trainer commits its consumed offsets to (for lag visibility only:
    resume uses the offsets in the trainer checkpoint)."""
    trainer_id: str = "trainer-0"
    """Stable name of this trainer in WeightUpdates, metrics and client ids."""
    standby: bool = False
    """Wait as a hot standby while another trainer holds the checkpoint dir, instead of exiting:
    everything is imported, and the moment the holder dies (its lock is freed by the OS, kill -9
    included) this process takes over from the newest checkpoint. ``job.trainer_standby`` runs one
    beside the trainer. One process per trainer only (not under torchrun / deepspeed)."""
    lr: float = Field(1e-4, gt=0, le=1.0)
    """Learning rate (after warmup)."""
    engine: EngineConfig = TorchEngineConfig()
    """The train engine: ``type = "torch"``, ``"deepspeed"``, ``"sim"`` (a load generator for benchmarks), or a
    user engine ``"package.module:Class"`` (settings in ``options``)."""
    optim: OptimConfig = OptimConfig()
    advantage: AdvantageConfig = GrpoAdvantageConfig()
    """``[trainer.advantage]``: ``estimator`` and that estimator's keys (``loss_config.py``)."""
    loss: LossConfig = PPOClipLossConfig()
    """``[trainer.loss]``: ``type``, that loss's keys, and the keys every loss shares (``loss_config.py``)."""
    lora: LoraConfig | None = None
    """LoRA adapters on a frozen base (``[trainer.lora]``); None (default): full fine-tuning, full weights published."""
    micro_batch_size: int = Field(8, ge=1, le=4096)
    """Samples per forward/backward; gradients accumulate over micro-batches. Ignored when
    ``max_tokens_per_micro_batch`` is set (then tokens bound a micro-batch)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=2, le=10_000_000)
    """Token budget of one forward/backward: a micro-batch takes length-sorted samples while its
    tokens stay within this (padded rows x longest row; with ``packing``, the sum of lengths). A
    sample longer than the budget gets a micro-batch of its own. None: ``micro_batch_size`` samples."""
    max_tokens_per_step: int | None = Field(None, ge=2, le=1_000_000_000)
    """Most (prompt + response) tokens in one optimizer step: a minibatch above this is split into
    consecutive optimizer steps (each sample still in exactly one). None: no limit."""
    packing: bool = False
    """Padding-free micro-batches: a micro-batch's samples are concatenated into one row with
    ``position_ids`` restarting at 0 per sample, so attention stays within each sample (the HF
    attention implementations sdpa/eager build a block-causal mask from them; flash-attention uses
    varlen kernels). The loss equals the padded computation's (tests/test_packing.py)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a closed group whose trainable samples' rewards are all equal (zero
    variance, hence zero advantage) is filtered before it counts towards the step's G; the step
    waits for more groups instead. Filtered groups are counted (``groups_filtered``), listed in the
    steps log and reported to producers as consumed (pipeline.control), so admission keeps supplying."""
    dynamic_sampling_tol: float = Field(1e-9, ge=0)
    """dynamic_sampling: rewards whose max - min is at most this count as equal."""
    overlong_filter: bool = False
    """Mask out truncated samples (finish_reason "length": the response hit its token budget):
    they keep their place in their group's advantage baseline but get no gradient and no loss
    weight (DAPO's overlong filtering). Counted as ``overlong_masked``."""
    minibatches: int = Field(1, ge=1, le=64)
    """Optimizer steps per trainer step: the G groups' samples are split into this many
    minibatches, each used by exactly one optimizer step. The version advances once per trainer step."""
    group_timeout_s: float = Field(300.0, gt=0)
    """A group still incomplete this long after its first sample arrived is closed."""
    incomplete_groups: Literal["drop", "train"] = "drop"
    """What a closed incomplete group does: drop (counted, no gradient) or train on the samples it has.
    Either way it counts towards the step's G (pipeline.control)."""
    group_order: Literal["arrival", "sequence"] = "arrival"
    """Which closed groups a step takes. ``arrival``: the G oldest (group_seq, version_min, closing
    order) among those closed when the step starts, so the choice depends on the order in which
    partitions were fetched; no step ever waits for a particular group. ``sequence``: deterministic
    for a finished log (``rlstream replay``): a step is planned only when the trainer has read
    rl.scored to its end, and takes groups in (group_seq, group_id) order, waiting for an older
    group still open (up to ``group_timeout_s``); dynamic sampling filters in that order too. In a
    live run it waits for the trainer to catch up before every step (slower, never unbounded)."""
    publish_every: int = Field(1, ge=1, le=1000)
    """Checkpoint and publish weights every this many trainer steps. The version counts trainer steps,
    so notices skip versions when > 1; must be <= rl.max_staleness + 1 or admission would deadlock."""
    keep_weight_versions: int = Field(3, ge=1)
    """Published weight versions kept in the store (older ones are deleted)."""
    shard_bytes: int = Field(256 * 2**20, ge=4096, le=64 * 2**30)
    """Full weights larger than this are published in Hugging Face's sharded layout
    (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``, format
    ``safetensors-sharded``): shards of at most this many bytes (a bigger tensor gets its own),
    written and read in parallel and verified one by one. Smaller ones stay one ``model.safetensors``."""
    publish_hf: bool = False
    """Also make every published full-weights version directory a Hugging Face model directory:
    the model's config.json, generation_config.json and tokenizer files beside its safetensors, so
    ``AutoModelForCausalLM.from_pretrained`` and a stock vLLM server load it. The WeightUpdate then
    carries ``metadata["hf_dir"]`` (the directory's URI). Not with ``lora``: adapter versions are
    PEFT adapter directories."""
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
    """Periodic MetricEvent interval (one is also sent after every trainer step); inside a step
    that lasts longer, the interval of its progress events (phase, micro-batch i of n)."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus /metrics on this port; 0: off."""
    seed: int = 0
    """Seeds torch (dropout-free models are deterministic anyway) and the minibatch split."""
    dist_timeout_s: float = Field(1800.0, gt=0)
    """torch.distributed collective timeout under torchrun/deepspeed launcher."""

    @model_validator(mode="after")
    def _schedule(self):
        if self.optim.lr_schedule != "constant" and self.optim.decay_steps is None and self.max_steps == 0:
            raise ValueError(
                f"trainer.optim.lr_schedule = {self.optim.lr_schedule!r} needs trainer.optim.decay_steps "
                "or trainer.max_steps"
            )
        return self

    @model_validator(mode="after")
    def _publish_hf_full_weights(self):
        if self.publish_hf and self.lora is not None:
            raise ValueError(
                "trainer.publish_hf writes full-weight versions as HF model directories; with trainer.lora every "
                "version is a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) already"
            )
        return self

    def decay_steps(self) -> int:
        """Optimizer step where the LR decay ends (``optim.decay_steps`` or max_steps x minibatches)."""
        return self.optim.decay_steps or max(1, self.max_steps * self.minibatches)
