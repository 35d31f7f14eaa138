"""The simulated agent environment of ``rlstream bench agentic``: a tool-calling episode with a
fixed number of turns whose every ``step`` is a tool call of long-tailed latency.

Each episode runs ``turns`` model turns; after each, ``step`` sleeps the tool call's latency and
answers a short observation; the episode is done after the last turn's step. The latency is
lognormal (median ``median_s``, shape ``sigma``) clipped to ``[min_s, max_s]``, drawn from the
trajectory id and the turn number, so every mode and every k of the benchmark sees the same
workload. It is a plug-in by ``module:Class`` (``rlstream.dev.bench.agent_env:SimToolEnv``), not a
registered environment: it does nothing but wait.

What this is not: a tool or a model of any real tool; it scores nothing (reward 0).
"""

from __future__ import annotations

import math
import random
import time
import zlib

from producers.envs import Environment, StepResult

DEFAULTS = {"turns": 4, "median_s": 0.4, "sigma": 0.8, "min_s": 0.1, "max_s": 2.0, "seed": 0}
"""The benchmark's workload, chosen from what ROLL Flash describes for agentic tasks (several
turns, environment latency of 0.1-2 s, long-tailed) before anything was measured."""
OBSERVATION = "ok;"


def tool_latency(options: dict, key: str, turn: int) -> float:
    """Seconds the tool call after turn ``turn`` (1-based) of trajectory ``key`` takes."""
    o = {**DEFAULTS, **options}
    rng = random.Random(zlib.crc32(f"{o['seed']}:{key}:{turn}".encode()))
    x = o["median_s"] * math.exp(o["sigma"] * rng.gauss(0.0, 1.0))
    return min(max(x, o["min_s"]), o["max_s"])


def mean_latency(options: dict, n: int = 50_000) -> float:
    """Mean tool-call latency of the configured distribution (Monte Carlo over ``n`` calls)."""
    return sum(tool_latency(options, f"mc/{i}", 1) for i in range(n)) / n


class SimToolEnv(Environment):
    """``turns`` turns, each followed by a tool call that sleeps ``tool_latency``; options as
    ``DEFAULTS``. EOS does not end the episode (the sim engine may end a turn with it)."""

    eos_ends_episode = False

    @classmethod
    def check_options(cls, options, import_dirs=()) -> None:
        from pipeline.errors import ConfigError

        unknown = set(options) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"SimToolEnv: unknown options {sorted(unknown)}; known: {sorted(DEFAULTS)}")

    def reset(self, prompt: dict, sample_index: int) -> str:
        self.key = f"{prompt['group_id']}/{sample_index}"
        self.turn = 0
        self.turns = int({**DEFAULTS, **self.config}["turns"])
        return prompt["text"]

    def step(self, action: str) -> StepResult:
        self.turn += 1
        delay = tool_latency(self.config, self.key, self.turn)
        time.sleep(delay)
        return StepResult(OBSERVATION, 0.0, self.turn >= self.turns, {"counts": {"tool_calls": 1}})
