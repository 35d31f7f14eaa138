"""Rollout engines (hf, vllm, openai) behind one interface; see ``producers.engines.base``."""

from producers.engines.base import Engine, GenOutput, GenRequest, build_engine

__all__ = ["Engine", "GenOutput", "GenRequest", "build_engine"]
