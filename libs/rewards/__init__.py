"""Reward functions (``REWARDS``: built-ins and ``module:function`` plug-ins), the task router that
sums them per task, the scoring pool (processes or threads, hard timeouts) and the code sandbox.
Used by the reward workers (``consumers.reward``) and the evaluator (``consumers.eval``)."""

from libs.rewards.base import REWARDS, RewardResult, register

__all__ = ["REWARDS", "RewardResult", "register"]
