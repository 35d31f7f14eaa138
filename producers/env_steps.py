"""Environment steps off the rollout worker's loop, each with a deadline.

``EnvSteps`` runs ``env.step`` calls on ``rollout.env.workers`` daemon threads. The worker polls
``finished()`` every loop: a step that returned, one that raised (``env_error``) and one still
running past ``rollout.env.step_timeout_s`` (``env_timeout``) come back; the worker dead-letters
the episodes that failed and the other episodes go on. A Python thread cannot be stopped, so the
thread of a step past its deadline is abandoned (it ends on its own whenever the step returns,
and being a daemon it never holds up the process's exit) and a new thread takes its place: a hung
environment costs a thread, never a slot of the others. Time waiting for a thread does not count
towards the deadline.

``turn_sync`` (``rollout.env.turn_sync``, a benchmark baseline) makes the steps turn-synchronous
as in a batch framework: a submitted step is held until the worker calls ``dispatch`` (it does
when no sample is generating), and the steps of a dispatched batch come back from ``finished``
together, once every one of them has ended; ``stepping`` tells the worker to start no generation
meanwhile.

What this is not: a sandbox; a step that spins forever keeps its CPU until the process ends (the
``tools`` environment's ``module:function`` tools run in a tool-runner process that is killed at
the call's deadline, ``libs.tools.runner``, so a tool cannot do this). Step threads are daemons:
they never hold up the worker's exit after SIGTERM.
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

    def __init__(self, workers: int, timeout_s: float, name: str = "env-step", turn_sync: bool = False):
        self.timeout_s, self.name, self.turn_sync = timeout_s, name, turn_sync
        self._jobs: queue.SimpleQueue[EnvStep | None] = queue.SimpleQueue()
        self._pending: list[EnvStep] = []
        self._held: list[EnvStep] = []
        """turn_sync: submitted, not dispatched yet."""
        self._ended: list[EnvStep] = []
        """turn_sync: ended steps of the dispatched batch, kept until the whole batch has ended."""
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
        if self.turn_sync:
            self._held.append(step)
            return
        self._pending.append(step)
        self._jobs.put(step)

    def dispatch(self) -> int:
        """turn_sync: run the held steps (the worker calls it when no sample is generating);
        returns how many started. A no-op while a dispatched batch is still out."""
        if not self._held or self.stepping():
            return 0
        batch, self._held = self._held, []
        for step in batch:
            self._pending.append(step)
            self._jobs.put(step)
        return len(batch)

    def stepping(self) -> bool:
        """turn_sync: a dispatched batch has not all come back: the worker starts no generation."""
        return self.turn_sync and bool(self._pending or self._ended)

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
        if not self.turn_sync:
            return out
        self._ended.extend(out)
        if self._pending:
            return []
        out, self._ended = self._ended, []
        return out

    def samples(self) -> list:
        return [s.sample for s in (*self._pending, *self._ended, *self._held)]

    def __len__(self) -> int:
        return len(self._pending) + len(self._ended) + len(self._held)

    def close(self) -> None:
        """Let the idle threads end (a running step's thread ends after it)."""
        self._pending, self._ended, self._held = [], [], []
        for _ in range(self._threads):
            self._jobs.put(None)
