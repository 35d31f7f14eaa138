"""Rollout engines behind one interface (``libs.engines.base.Engine``), in one registry.

``ENGINES`` maps ``rollout.engine.type`` to a class: the built-ins ``hf`` (transformers, CPU or
GPU), ``vllm`` (the vLLM Python engine), ``openai`` (any OpenAI-compatible server) and ``sim`` (a
load generator for benchmarks), imported only when used, or a user class named by its dotted
path (``type = "my_pkg.engines:MyEngine"``, with its settings in ``rollout.engine.options``).
Every engine is built as ``cls(config, EngineContext)``.
"""

from __future__ import annotations

from libs.engines.base import Engine, EngineContext, GenOutput, GenRequest
from pipeline.plugins import Registry

ENGINES = Registry(
    "rollout engine",
    {
        "hf": "libs.engines.hf:HFEngine",
        "vllm": "libs.engines.vllm:VLLMEngine",
        "openai": "libs.engines.openai:OpenAIEngine",
        "sim": "libs.engines.sim:SimEngine",
    },
    base=Engine,
)


def build_engine(engine_cfg, ctx: EngineContext) -> Engine:
    """The engine ``engine_cfg.type`` names, holding the version-0 model of ``ctx.model_dir``."""
    return ENGINES.build(engine_cfg.type, engine_cfg, ctx)


__all__ = ["ENGINES", "Engine", "EngineContext", "GenOutput", "GenRequest", "build_engine"]
