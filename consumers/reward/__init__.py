"""Reward workers and reward functions. ``REWARDS`` is the registry of reward functions (built-ins
by name, imported lazily; plug-ins by ``module:function``)."""

from libs.rewards.base import REWARDS, RewardResult, register

__all__ = ["REWARDS", "RewardResult", "register"]
