"""Base class for every rlstream config model: strict (unknown keys are errors), validated on
assignment. Lives apart from ``pipeline.config`` so role packages can import it without cycles."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
