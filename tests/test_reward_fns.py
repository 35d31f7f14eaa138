"""Reward functions used by the reward tests through ``module:function`` (no tests here).

They live in an importable module so spawned scoring processes and CLI workers can load them.
"""

from __future__ import annotations

import os
import time

from libs.rewards.base import RewardResult


def length_ratio(traj: dict, target: int = 10) -> float:
    """A plain-number reward: min(len(response) / target, 1)."""
    return min(len(traj["response_text"]) / target, 1.0)


def with_details(traj: dict) -> tuple[float, dict]:
    return 0.5, {"chars": len(traj["response_text"])}


def picky(traj: dict) -> RewardResult:
    """Raises on RAISE, hangs on HANG, kills its process on DIE, returns NaN on NAN, else 1.0."""
    text = traj["response_text"]
    if text == "RAISE":
        raise ValueError("picky refuses RAISE")
    if text == "HANG":
        while True:
            time.sleep(0.05)
    if text == "DIE":
        os._exit(3)
    if text == "NAN":
        return RewardResult(float("nan"))
    return RewardResult(1.0, {"len": float(len(text))})


def slow_exact(traj: dict, ms: float = 5.0) -> float:
    """Exact match on the reference answer, after sleeping ``ms`` (to spread batches over time)."""
    import json

    time.sleep(ms / 1000)
    return float(traj["response_text"] == json.loads(traj["reference"])["answer"])


def not_a_number(traj: dict):
    return "one"
