"""Configuration of the prompt feed and the rollout workers."""

from __future__ import annotations

from pydantic import Field

from pipeline.configbase import StrictModel


class FeedConfig(StrictModel):
    epochs: int = Field(1, ge=1)
    """Passes over the dataset."""


class RolloutConfig(StrictModel):
    max_inflight: int = Field(32, ge=1)
    """Most samples the worker keeps in its engine at once (queue scheduling)."""
