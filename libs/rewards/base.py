"""The reward-function interface, the registry of built-ins, ``module:function`` plug-ins, weighted
combinations and the task -> reward router.

A reward function is a callable ``score(trajectory: dict) -> RewardResult`` where the trajectory
is the decoded Trajectory record. ``REWARDS`` (the plug-in seam of this kind, see
``pipeline.plugins``) maps a name to a *factory*, imported lazily: the config's ``kwargs`` (its
config) go to the factory, together with the worker-wide context values it asks for by parameter
name (``sandbox``), and it returns the scoring callable. A ``module:function`` reference is the
scoring callable itself; its ``kwargs`` are passed on every call.

This module does no I/O and imports no heavy library; it neither times out nor isolates calls
(the pool in ``libs.rewards.pool`` does).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import ConfigError
from pipeline.plugins import Registry, is_dotted, load_object


@dataclass(frozen=True)
class RewardResult:
    """A scalar reward and named sub-scores (for logging; only ``reward`` is trained on)."""

    reward: float
    details: dict[str, float] = field(default_factory=dict)


RewardFn = Callable[[dict], RewardResult]
Factory = Callable[..., RewardFn]
REWARDS = Registry(
    "reward",
    {
        "exact_match": "libs.rewards.builtin:exact_match",
        "regex": "libs.rewards.builtin:regex",
        "format": "libs.rewards.builtin:format_check",
        "math": "libs.rewards.builtin:math_answer",
        "overlong_penalty": "libs.rewards.builtin:overlong_penalty",
        "env_reward": "libs.rewards.builtin:env_reward",
        "reasoning_gym": "libs.rewards.reasoning_gym:reasoning_gym_reward",
        "code": "libs.rewards.code:code_tests",
        "http": "libs.rewards.http:http_reward",
        "openai_judge": "libs.rewards.http:openai_judge",
    },
    hint="module:function",
)


class RewardError(Exception):
    """A reward function could not score a trajectory (bad reference, unreachable model, ...)."""


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator: register a factory ``(**kwargs) -> score`` under ``name``."""
    return REWARDS.register(name)


def registered() -> list[str]:
    """Names of the registered reward factories (built-ins included)."""
    return REWARDS.names()


def as_result(value: Any) -> RewardResult:
    """Normalise what a reward function returned: RewardResult, a number, or (number, details)."""
    if isinstance(value, RewardResult):
        res = value
    elif isinstance(value, tuple) and len(value) == 2:
        res = RewardResult(float(value[0]), {str(k): float(v) for k, v in dict(value[1]).items()})
    elif isinstance(value, bool | int | float):
        res = RewardResult(float(value))
    else:
        raise TypeError(f"a reward function must return RewardResult, a number or (number, dict), not {value!r}")
    if not math.isfinite(res.reward):
        raise ValueError(f"reward is not finite: {res.reward}")
    return res


def resolve_callable(ref: str, dirs: Iterable = ()) -> Callable:
    """Import ``package.module:attr`` (``attr`` may be dotted; the module looked up in ``dirs``
    first, ``reward.import_dirs``); ConfigError if it is not callable."""
    if not is_dotted(ref):
        raise ConfigError(f"reward {ref!r}: expected module:function")
    obj = load_object(ref, list(dirs))
    if not callable(obj):
        raise ConfigError(f"reward {ref!r} is not callable")
    return obj


def build(name: str, kwargs: dict | None = None, context: dict | None = None) -> RewardFn:
    """A scoring callable from a registry name or ``module:function`` (ConfigError if unknown).

    ``context`` holds worker-wide defaults (e.g. ``sandbox``) given to a built-in factory that
    takes a parameter of that name and was not given it in ``kwargs``.
    """
    kwargs = dict(kwargs or {})
    if ":" in name:
        fn = resolve_callable(name, (context or {}).get("import_dirs", ()))

        def custom(trajectory: dict) -> RewardResult:
            return as_result(fn(trajectory, **kwargs))

        custom.__name__ = name
        return custom
    factory = REWARDS.get(name)
    params = inspect.signature(factory).parameters
    for key, value in (context or {}).items():
        if key in params and key not in kwargs:
            kwargs[key] = value
    try:
        scorer = factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"reward {name!r}: bad kwargs {sorted(kwargs)}: {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"reward {name!r}: {exc}") from exc

    def builtin(trajectory: dict) -> RewardResult:
        return as_result(scorer(trajectory))

    builtin.__name__ = name
    return builtin


class WeightedReward:
    """``reward = sum(weight_i * reward_i)``. Details hold each term's unweighted reward under its
    label and the term's own details as ``label.key``."""

    def __init__(self, terms: Iterable[tuple[str, float, RewardFn]]):
        self.terms: list[tuple[str, float, RewardFn]] = []
        seen: dict[str, int] = {}
        for label, weight, fn in terms:
            n = seen[label] = seen.get(label, 0) + 1
            self.terms.append((label if n == 1 else f"{label}#{n}", float(weight), fn))
        if not self.terms:
            raise ConfigError("a weighted reward needs at least one term")

    def __call__(self, trajectory: dict) -> RewardResult:
        total, details = 0.0, {}
        for label, weight, fn in self.terms:
            try:
                res = fn(trajectory)
            except Exception as exc:  # the dead letter names the term that raised (pool._call)
                exc.reward_term = label
                raise
            total += weight * res.reward
            details[label] = res.reward
            for k, v in res.details.items():
                details[f"{label}.{k}"] = float(v)
        return as_result(RewardResult(total, details))


def build_weighted(specs, context: dict | None = None) -> WeightedReward:
    """From a list of RewardSpec (name, weight, kwargs)."""
    return WeightedReward((s.name, s.weight, build(s.name, s.kwargs, context)) for s in specs)


class TaskRouter:
    """Scores a trajectory with the reward configured for its ``task`` (else the default)."""

    def __init__(self, reward_cfg):
        ctx = {"sandbox": reward_cfg.sandbox, "import_dirs": reward_cfg.import_dirs}
        self.default = build_weighted(reward_cfg.default, ctx) if reward_cfg.default else None
        self.by_task = {task: build_weighted(specs, ctx) for task, specs in reward_cfg.tasks.items()}

    def uses(self, name: str) -> bool:
        """True if any task's reward has a term called ``name``."""
        combos = [*self.by_task.values(), *([self.default] if self.default else [])]
        return any(label.split("#")[0] == name for c in combos for label, _, _ in c.terms)

    def reward_for(self, task: str) -> WeightedReward:
        fn = self.by_task.get(task, self.default)
        if fn is None:
            raise RewardError(f"no reward configured for task {task!r} and no default")
        return fn

    def __call__(self, trajectory: dict) -> RewardResult:
        return self.reward_for(trajectory.get("task", ""))(trajectory)


def parse_reference(trajectory: dict) -> dict:
    """The trajectory's ``reference`` JSON as a dict. Empty -> {}; a JSON scalar -> {"answer": it}.

    Invalid JSON raises RewardError (the trajectory goes to the DLQ as reward_error).
    """
    raw = trajectory.get("reference") or ""
    if not raw.strip():
        return {}
    try:
        ref = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RewardError(f"reference is not valid JSON: {exc}") from exc
    return ref if isinstance(ref, dict) else {"answer": ref}


def reference_answer(trajectory: dict, key: str = "answer") -> str:
    """``reference[key]`` as a string; RewardError if missing."""
    ref = parse_reference(trajectory)
    if key not in ref or ref[key] is None:
        raise RewardError(f"reference has no {key!r} (keys: {sorted(ref)})")
    value = ref[key]
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, list | dict) else str(value)
