"""Configuration of the trainer."""

from __future__ import annotations

from pydantic import Field

from pipeline.configbase import StrictModel


class TrainerConfig(StrictModel):
    group_id: str = "rlstream-trainer"
    """Consumer group of the trainer."""
    lr: float = Field(1e-4, gt=0)
    """Learning rate."""
