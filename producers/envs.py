"""Environments for multi-turn (agentic) rollouts: the ``Environment`` interface, the built-in
guess-the-number game, and the factory that maps a config spec to a class.

An episode alternates model turns and environment observations: ``reset`` gives the first
observation (usually the prompt text), ``step(action)`` takes the text of one model turn and
returns the next observation, a reward and whether the episode is over. The rollout worker runs
``step`` on a thread pool with a deadline (``producers.env_steps``), so a slow environment (a
sandbox, a tool call) never blocks the engine or other episodes, and a failing one ends only its
own episode, in a dead letter. Environment tokens are recorded with loss_mask 0 and logprob 0.

Environments are plug-ins like engines: ``ENVIRONMENTS`` maps a name to a class (the built-ins
``guess_number``, ``tools``, the tool-calling chat environment of ``producers.tool_env``, and
``textarena``, the games of the textarena library (``producers.textarena_env``), ``verifiers``,
the tasksets of PrimeIntellect's verifiers library (``producers.verifiers_env``), or
``package.module:Class``), and each episode gets a new instance built as ``cls(config, ctx)``:
the task's options (``rollout.env.options.<task>``) and an ``EnvContext``.

What this is not: a reward function. Rewards given here go into the trajectory's metadata
(``env_reward``); the reward role still scores the trajectory with its verifier.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pipeline.plugins import Registry


@dataclass
class StepResult:
    observation: str
    """Text appended to the context after the model's turn (loss_mask 0)."""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    """Anything the environment reports; ``info["counts"]`` (name -> number) is added up by the
    rollout worker into its metrics as ``env.<name>`` (e.g. the tool environment's well-formed
    and malformed calls)."""


@dataclass
class EnvContext:
    """What every environment is given besides its options."""

    task: str = ""
    """The task the episode belongs to."""
    worker_id: str = ""
    """The rollout worker running it."""
    tokenizer: Any = None
    """The model's tokenizer (its chat template renders conversations); None outside a worker."""
    import_dirs: tuple = ()
    """Where ``module:Attr`` plug-ins of the environment are looked up first (``rollout.env.import_dirs``)."""


class Environment(ABC):
    """One instance per episode; ``reset`` once, then ``step`` after every model turn.
    Subclasses take ``(config: dict, ctx: EnvContext)``.

    ``step`` runs on a worker thread with a deadline (``rollout.env.step_timeout_s``): one that
    raises or runs past it ends its episode with a dead letter (error_type ``env_error`` or
    ``env_timeout``); the worker and the other episodes go on."""

    eos_ends_episode: bool = True
    """An EOS at the end of a model turn ends the episode (a plain-text game). False for chat
    environments, where EOS closes every assistant message and ``step`` decides."""
    renders_chat: bool = False
    """``reset`` returns text rendered by the chat template, special tokens included: the worker
    tokenizes it without adding any."""

    @classmethod
    def check_options(cls, options: dict[str, Any], import_dirs=()) -> None:
        """Refuse bad options at the worker's start (ConfigError) rather than at the first
        episode. The default accepts anything."""
        return None

    def __init__(self, config: dict[str, Any] | None = None, ctx: EnvContext | None = None):
        self.config = dict(config or {})
        self.ctx = ctx or EnvContext()

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
    ``reference["hi"]`` (defaults: the options ``lo`` and ``hi``, else 1 and 100). Reward: 1.0 on
    the guess that is correct.
    """

    def reset(self, prompt: dict, sample_index: int) -> str:
        ref = json.loads(prompt.get("reference") or "{}") if prompt.get("reference") else {}
        if not isinstance(ref, dict):
            ref = {}
        self.lo = int(ref.get("lo", self.config.get("lo", 1)))
        self.hi = int(ref.get("hi", self.config.get("hi", 100)))
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


ENVIRONMENTS = Registry(
    "environment",
    {
        "guess_number": "producers.envs:GuessNumberEnv",
        "tools": "producers.tool_env:ToolEnv",
        "textarena": "producers.textarena_env:TextArenaEnv",
        "verifiers": "producers.verifiers_env:VerifiersEnv",
    },
    base=Environment,
)


def env_factory(spec: str, dirs=()) -> type[Environment]:
    """The Environment class a config names: a registered name or ``module:Class`` (its module
    looked up in ``dirs`` first, then the import path: ``rollout.env.import_dirs``)."""
    return ENVIRONMENTS.get(spec, dirs)


def make_env(spec: str, options: dict[str, Any], ctx: dict[str, Any], dirs=(), check: bool = False) -> Environment:
    """A new instance of the environment ``spec`` names, for one episode of a role that plays
    episodes outside the rollout worker (the evaluator, which the application layer hands this
    function, since roles do not import each other). ``ctx``: the ``EnvContext`` fields (task,
    worker_id, tokenizer); ``check``: refuse bad options first (``check_options``, ConfigError)."""
    cls = env_factory(spec, dirs)
    if check:
        cls.check_options(options, dirs)
    return cls(options, EnvContext(**ctx, import_dirs=tuple(dirs)))
