"""Advantage estimators for one GRPO group: every sample of a prompt gets one scalar advantage,
broadcast over its response tokens by the loss.

* ``grpo``: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (DeepSeekMath), std with n - 1 by default.
* ``dr_grpo``: ``A_i = r_i - mean(r)`` (Dr. GRPO: no std normalisation).
* ``rloo``: ``A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean(r))`` (leave-one-out).

A group of one sample has advantage 0 under every estimator (nothing to compare against). Pure
Python: no torch, so it is cheap to test and to call on the consumer thread. Not a value
function or GAE: there is no critic in rlstream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def grpo(rewards: Sequence[float], eps: float = 1e-6, unbiased: bool = True) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1 if unbiased else n)
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]


def dr_grpo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    return [r - mean for r in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def compute(rewards: Sequence[float], cfg) -> list[float]:
    """Advantages of one group under ``cfg`` (an ``AdvantageConfig``)."""
    if cfg.estimator == "grpo":
        return grpo(rewards, cfg.eps, cfg.std_unbiased)
    if cfg.estimator == "dr_grpo":
        return dr_grpo(rewards)
    if cfg.estimator == "rloo":
        return rloo(rewards)
    raise ValueError(f"unknown advantage estimator {cfg.estimator!r}")
