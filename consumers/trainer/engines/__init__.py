"""Train engines behind one interface (``base.TrainEngine``), in one registry.

``TRAIN_ENGINES`` maps ``trainer.engine.type`` to a class: ``torch`` (one process, or DDP under
torchrun), ``deepspeed`` (ZeRO 0-3) and ``sim`` (a load generator for benchmarks, not a
trainer), imported only when used, or a user class named by its dotted path
(``type = "my_pkg.train:MyEngine"``, settings in ``trainer.engine.options``). Every engine is
built as ``cls(config, TrainContext)``.
"""

from __future__ import annotations

from consumers.trainer.engines.base import TrainContext, TrainEngine, dist_env
from pipeline.errors import ConfigError
from pipeline.plugins import Registry

TRAIN_ENGINES = Registry(
    "train engine",
    {
        "torch": "consumers.trainer.engines.torch_engine:TorchEngine",
        "deepspeed": "consumers.trainer.engines.deepspeed_engine:DeepSpeedEngine",
        "sim": "consumers.trainer.engines.sim_engine:SimTrainEngine",
    },
    base=TrainEngine,
)


def build_engine(engine_cfg, ctx: TrainContext) -> TrainEngine:
    """The engine ``engine_cfg.type`` names, holding the model of ``ctx.model_dir``; ConfigError
    if it was launched with several ranks but does not declare ``multi_process``."""
    cls = TRAIN_ENGINES.get(engine_cfg.type)
    world = dist_env()[1]
    if world > 1 and not cls.multi_process:
        raise ConfigError(
            f"trainer.engine.type = {engine_cfg.type!r} runs in one process; it was launched with {world} ranks "
            "(torchrun / the deepspeed launcher)"
        )
    return cls(engine_cfg, ctx)


__all__ = ["TRAIN_ENGINES", "TrainContext", "TrainEngine", "build_engine"]
