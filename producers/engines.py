"""The generation engines moved to ``libs.engines`` (a library the rollout workers and the evaluator
share). This name stays so that plug-ins written as ``from producers.engines import Engine`` keep
working; new code imports ``libs.engines``."""

from libs.engines import ENGINES, Engine, EngineContext, GenOutput, GenRequest, build_engine

__all__ = ["ENGINES", "Engine", "EngineContext", "GenOutput", "GenRequest", "build_engine"]
