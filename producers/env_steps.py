"""Environment steps off the rollout worker's loop, each with a deadline.

``EnvSteps`` runs ``env.step`` calls on ``rollout.env.workers`` daemon threads. The worker polls
``finished()`` every loop: a step that returned, one that raised (``env_error``) and one still
running past ``rollout.env.step_timeout_s`` (``env_timeout``) come back; the worker dead-letters
the episodes that failed and the other episodes go on. A Python thread cannot be stopped, so the
thread of a step past its deadline is abandoned (it ends on its own whenever the step returns,
and being a daemon it never holds up the process's exit) and a new thread takes its place: a hung
environment costs a thread, never a slot of the others. Time waiting for a thread does not count
towards the deadline.

What this is not: a sandbox; a step that spins forever keeps its CPU until the process ends.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from producers.envs import StepResult


@dataclass(eq=False)
class EnvStep:
    sample: Any
    fn: Callable
    args: tuple
    started: float | None = None
    ended: bool = False
    abandoned: bool = False
    result: Any = None
    error_type: str | None = None
    """None (it returned ``result``), ``env_error`` or ``env_timeout``."""
    reason: str = ""


class EnvSteps:
    """The steps in flight: ``submit`` one, collect the ended ones with ``finished``."""

    def __init__(self, workers: int, timeout_s: float, name: str = "env-step"):
        self.timeout_s, self.name = timeout_s, name
        self._jobs: queue.SimpleQueue[EnvStep | None] = queue.SimpleQueue()
        self._pending: list[EnvStep] = []
        self._threads = 0
        self._lock = threading.Lock()
        self.abandoned = 0
        """Threads left behind by steps past their deadline."""
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._serve, name=f"{self.name}-{self._threads}", daemon=True).start()

    def _serve(self) -> None:
        while (step := self._jobs.get()) is not None:
            step.started = time.monotonic()
            try:
                step.result = step.fn(*step.args)
                if not isinstance(step.result, StepResult):
                    step.error_type = "env_error"
                    step.reason = f"env.step returned {type(step.result).__name__}, not a StepResult"
            except BaseException as exc:  # an environment's failure ends its episode, not the worker
                step.error_type, step.reason = "env_error", f"{type(exc).__name__}: {exc}"
            with self._lock:
                step.ended = True
                if step.abandoned:
                    return  # replaced while it ran

    def submit(self, sample, fn: Callable, *args) -> None:
        step = EnvStep(sample, fn, args)
        self._pending.append(step)
        self._jobs.put(step)

    def finished(self) -> list[EnvStep]:
        """Steps that returned, raised or ran past the deadline since the last call, in submission order."""
        now, out, keep = time.monotonic(), [], []
        for step in self._pending:
            if step.ended:
                out.append(step)
            elif step.started is not None and now - step.started > self.timeout_s:
                with self._lock:
                    step.abandoned = not step.ended  # else it has just returned: an ordinary result
                if step.abandoned:
                    step.error_type = "env_timeout"
                    step.reason = f"env.step ran past rollout.env.step_timeout_s = {self.timeout_s:g}s"
                    self.abandoned += 1
                    self._spawn()
                out.append(step)
            else:
                keep.append(step)
        self._pending = keep
        return out

    def samples(self) -> list:
        return [s.sample for s in self._pending]

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Let the idle threads end (a running step's thread ends after it)."""
        self._pending = []
        for _ in range(self._threads):
            self._jobs.put(None)
