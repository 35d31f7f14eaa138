"""Writing one published weights version and the WeightUpdate that announces it (rank 0).

Full fine-tuning writes ``<store>/v<version>/model.safetensors`` (``kind = "full"``); LoRA
(``trainer.lora``) writes only the adapter in PEFT's layout (``kind = "adapter"``, with its rank,
alpha, target modules and the fingerprint of the base model it was trained on). Either way the
file is completely written before the notice exists, and the notice carries the trainer's
consumed-group count (``consumed_groups``, admission control: pipeline.control).

What this is not: the order of the checkpoint protocol (``worker.Trainer._checkpoint``) nor the
publishing call itself (``pipeline.control.publish_weight_update``).
"""

from __future__ import annotations

from pipeline.checkpoint import write_adapter, write_weights
from pipeline.control import now_ms


def write_version(
    engine,
    state_dict: dict,
    store: str,
    version: int,
    step: int,
    trainer_cfg,
    consumed: int,
    base_sha256: str = "",
    write_full=write_weights,
) -> dict:
    """Write ``state_dict`` (what ``engine.state_dict()`` returned) as version ``version``; returns
    the WeightUpdate record to publish once the trainer's own checkpoint is durable.
    ``write_full``: the full-weights writer (the trainer passes its module's, which benchmarks time)."""
    update = {
        "version": version,
        "step": step,
        "created_at_ms": 0,
        "format": "safetensors",
        "trainer_id": trainer_cfg.trainer_id,
        "metadata": {"engine": trainer_cfg.engine.type},
        "kind": engine.weights_kind,
        "consumed_groups": int(consumed),
    }
    if engine.weights_kind == "adapter":
        conf = engine.adapter_config()
        uri, sha, nbytes = write_adapter(store, version, state_dict, conf)
        update.update(
            adapter_rank=int(conf["r"]),
            adapter_alpha=float(conf["lora_alpha"]),
            adapter_target_modules=sorted(conf["target_modules"]),
            base_sha256=base_sha256,
        )
    else:
        uri, sha, nbytes = write_full(store, version, state_dict)
    update.update(uri=uri, sha256=sha, bytes=nbytes, created_at_ms=now_ms())
    return update
