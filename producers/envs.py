"""Environments for multi-turn (agentic) rollouts: the ``Environment`` interface, the built-in
guess-the-number game, and the factory that maps a config spec to a class.

An episode alternates model turns and environment observations: ``reset`` gives the first
observation (usually the prompt text), ``step(action)`` takes the text of one model turn and
returns the next observation, a reward and whether the episode is over. The rollout worker runs
``step`` on a thread pool, so a slow environment (a sandbox, a tool call) never blocks the
engine or other episodes. Environment tokens are recorded with loss_mask 0 and logprob 0.

What this is not: a reward function. Rewards given here go into the trajectory's metadata
(``env_reward``); the reward role still scores the trajectory with its verifier.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class StepResult:
    observation: str
    """Text appended to the context after the model's turn (loss_mask 0)."""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(ABC):
    """One instance per episode; ``reset`` once, then ``step`` after every model turn."""

    @abstractmethod
    def reset(self, prompt: dict, sample_index: int) -> str:
        """Start an episode for one sample of ``prompt`` (a decoded Prompt record); return the first
        observation, the text the model is conditioned on."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's turn (its text, stop token included) and return what happens."""


class GuessNumberEnv(Environment):
    """Guess a secret integer in [lo, hi]; after each guess the environment answers ``higher``,
    ``lower``, ``correct`` or ``invalid`` (no integer in the turn).

    The secret is ``reference["secret"]`` if the prompt's reference has one, else it is derived
    from the group id and sample index (deterministic). Bounds come from ``reference["lo"]`` and
    ``reference["hi"]`` (default 1 and 100). Reward: 1.0 on the guess that is correct.
    """

    def reset(self, prompt: dict, sample_index: int) -> str:
        ref = json.loads(prompt.get("reference") or "{}") if prompt.get("reference") else {}
        if not isinstance(ref, dict):
            ref = {}
        self.lo, self.hi = int(ref.get("lo", 1)), int(ref.get("hi", 100))
        if "secret" in ref:
            self.secret = int(ref["secret"])
        else:
            h = hashlib.sha256(f"{prompt['group_id']}/{sample_index}".encode()).digest()
            self.secret = self.lo + int.from_bytes(h[:8], "little") % (self.hi - self.lo + 1)
        self.guesses = 0
        return prompt["text"]

    def step(self, action: str) -> StepResult:
        self.guesses += 1
        m = re.search(r"-?\d+", action)
        if m is None:
            return StepResult("invalid\n", 0.0, False, {"guess": None})
        guess = int(m.group())
        if guess == self.secret:
            return StepResult("correct\n", 1.0, True, {"guess": guess, "guesses": self.guesses})
        return StepResult("higher\n" if guess < self.secret else "lower\n", 0.0, False, {"guess": guess})


BUILTIN = {"guess_number": GuessNumberEnv}


def env_factory(spec: str):
    """A zero-argument callable making a new Environment: a built-in name or ``module:Class``."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"unknown environment {spec!r}: not one of {sorted(BUILTIN)} and not module:Class")
    mod, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(mod), name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {spec!r} is not an Environment subclass")
    return cls
