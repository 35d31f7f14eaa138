"""Train engines behind one interface (``base.TrainEngine``), built by ``type``:
``torch`` (one process, or DDP under torchrun), ``deepspeed`` (ZeRO 0-3) and ``sim`` (a load
generator for benchmarks, not a trainer). Heavy libraries are imported only inside the engine
that needs them."""

from __future__ import annotations


def build_engine(trainer_cfg, model_dir):
    """The engine named by ``trainer_cfg.engine.type``, holding the model at ``model_dir``."""
    kind = trainer_cfg.engine.type
    if kind == "torch":
        from consumers.trainer.engines.torch_engine import TorchEngine

        return TorchEngine(trainer_cfg, model_dir)
    if kind == "deepspeed":
        from consumers.trainer.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(trainer_cfg, model_dir)
    if kind == "sim":
        from consumers.trainer.engines.sim_engine import SimEngine

        return SimEngine(trainer_cfg, model_dir)
    raise ValueError(f"unknown train engine {kind!r}")
