"""Advantage estimators for one GRPO group: every sample of a prompt gets one scalar advantage,
broadcast over its response tokens by the loss.

* ``grpo``: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (DeepSeekMath), std with n - 1 by default.
* ``dr_grpo``: ``A_i = r_i - mean(r)`` (Dr. GRPO: no std normalisation).
* ``rloo``: ``A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean(r))`` (leave-one-out).

A group of one sample has advantage 0 under every estimator (nothing to compare against). Pure
Python: no torch, so it is cheap to test and to call on the consumer thread. Not a value
function or GAE: there is no critic in rlstream.

Every estimator is an ``Advantage`` in the registry ``ADVANTAGES``, chosen by
``[trainer.advantage] estimator``; a user estimator is named by its dotted path
(``estimator = "my_pkg.adv:MyAdvantage"``, an ``Advantage`` subclass or a plain function).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

from pipeline.plugins import Registry


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


class Advantage(ABC):
    """An advantage estimator: what every built-in is, and what a user estimator
    (``[trainer.advantage] estimator = "my_pkg.adv:MyAdvantage"``, its settings in ``options``)
    subclasses. Built as ``cls(config)``, ``config`` its ``[trainer.advantage]`` section;
    ``__call__(rewards)`` returns one advantage per reward of a group (the group's fresh samples)."""

    def __init__(self, config):
        self.config = config

    @abstractmethod
    def __call__(self, rewards: Sequence[float]) -> list[float]: ...


class FunctionAdvantage(Advantage):
    """A plain function ``fn(rewards) -> advantages`` as an ``Advantage``."""

    def __init__(self, fn, config):
        super().__init__(config)
        self.fn = fn

    def __call__(self, rewards: Sequence[float]) -> list[float]:
        return list(self.fn(rewards))


class GRPO(Advantage):
    def __call__(self, rewards: Sequence[float]) -> list[float]:
        return grpo(rewards, self.config.eps, self.config.std_unbiased)


class DrGRPO(Advantage):
    def __call__(self, rewards: Sequence[float]) -> list[float]:
        return dr_grpo(rewards)


class RLOO(Advantage):
    def __call__(self, rewards: Sequence[float]) -> list[float]:
        return rloo(rewards)


ADVANTAGES = Registry(
    "advantage estimator", hint="package.module:Name (a consumers.trainer.advantages.Advantage subclass or a function)"
)
"""``[trainer.advantage] estimator`` -> an ``Advantage`` subclass (or a function); ``module:Name`` works too."""
for _name, _cls in {"grpo": GRPO, "dr_grpo": DrGRPO, "rloo": RLOO}.items():
    ADVANTAGES.register(_name, _cls)


def build_advantage(cfg) -> Advantage:
    """The estimator ``cfg.estimator`` names (a built-in, or ``module:Name``), built with ``cfg``."""
    return ADVANTAGES.build_callable(cfg.estimator, cfg, Advantage, FunctionAdvantage)


def compute(rewards: Sequence[float], cfg) -> list[float]:
    """Advantages of one group under ``cfg`` (a ``[trainer.advantage]`` section)."""
    return build_advantage(cfg)(rewards)
