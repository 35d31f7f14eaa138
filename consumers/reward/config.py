"""Configuration of the reward workers."""

from __future__ import annotations

from pydantic import Field

from pipeline.configbase import StrictModel


class RewardConfig(StrictModel):
    group_id: str = "rlstream-reward"
    """Consumer group of the reward workers."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall-time limit of one reward call."""
