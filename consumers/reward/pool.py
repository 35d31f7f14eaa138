"""Score a batch of trajectories in parallel, each call under a wall-time limit.

``ProcessPool`` keeps ``size`` spawned processes, each holding its own TaskRouter built from the
reward config; a call past its deadline gets its process SIGKILLed (and, as root, the sandbox
uid of that process swept), then replaced. A process that dies mid-call is replaced and the
call retried once; a second death fails only that call.
``ThreadPool`` scores in threads of the worker itself: cheap for light rewards, but a call past its
deadline is abandoned, not stopped (Python cannot kill a thread).

Either way ``score(trajectories)`` returns one Outcome per input, in order, and never raises for
what a reward function does: an exception is ``reward_error``, a deadline ``reward_timeout``.
Pools are not thread-safe: one batch at a time.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait

from consumers.reward.base import TaskRouter
from pipeline.errors import RlstreamError
from pipeline.log import kv

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    ok: bool
    reward: float = 0.0
    details: dict[str, float] = field(default_factory=dict)
    error_type: str = ""
    """reward_error | reward_timeout"""
    reason: str = ""
    latency_ms: float = 0.0


def _call(router, traj: dict) -> tuple[str, object, float]:
    t0 = time.perf_counter()
    try:
        res = router(traj)
        out: tuple[str, object] = ("ok", (res.reward, dict(res.details)))
    except Exception as exc:  # a reward function's failure is data, not a crash
        out = ("error", f"{type(exc).__name__}: {exc}"[:2000])
    return out[0], out[1], (time.perf_counter() - t0) * 1000


def _outcome(kind: str, payload, ms: float) -> Outcome:
    if kind == "ok":
        reward, details = payload
        return Outcome(True, reward, details, latency_ms=ms)
    return Outcome(False, error_type="reward_error", reason=str(payload), latency_ms=ms)


def _timeout(timeout_s: float) -> Outcome:
    return Outcome(
        False, error_type="reward_timeout", reason=f"reward call exceeded {timeout_s} s", latency_ms=timeout_s * 1000
    )


# ---- processes --------------------------------------------------------------------------------
def _child_main(conn, reward_cfg_json: dict, log_level: str) -> None:
    from consumers.reward.config import RewardConfig
    from pipeline.log import setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle
    setup_logging(log_level)
    try:
        router = TaskRouter(RewardConfig.model_validate(reward_cfg_json))
        if router.uses("math"):
            from consumers.reward.builtin import _math_verify

            _math_verify()  # import math-verify now, not inside the first call's deadline
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the worker is gone
            return
        if msg is None:
            return
        idx, traj = msg
        kind, payload, ms = _call(router, traj)
        try:
            conn.send((idx, kind, payload, ms))
        except (BrokenPipeError, OSError):
            return


class _Slot:
    def __init__(self, ctx, reward_cfg, log_level: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(child, reward_cfg.model_dump(mode="json"), log_level), daemon=True
        )
        self.proc.start()
        child.close()
        self.ready = False
        self.task: tuple[int, float] | None = None  # (index, started)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()


class ProcessPool:
    def __init__(self, reward_cfg, size: int, timeout_s: float, log_level: str = "INFO"):
        self.cfg, self.size, self.timeout_s, self.log_level = reward_cfg, size, timeout_s, log_level
        self._ctx = mp.get_context("spawn")  # never fork a process that runs librdkafka threads
        self.slots: list[_Slot] = []
        self.killed = 0

    def start(self, timeout_s: float = 120.0) -> ProcessPool:
        self.slots = [_Slot(self._ctx, self.cfg, self.log_level) for _ in range(self.size)]
        deadline = time.monotonic() + timeout_s
        for slot in self.slots:
            self._await_ready(slot, deadline)
        return self

    def _await_ready(self, slot: _Slot, deadline: float) -> None:
        if not slot.conn.poll(max(0.0, deadline - time.monotonic())):
            raise RlstreamError("a scoring process did not start in time")
        try:
            msg = slot.conn.recv()
        except EOFError:
            raise RlstreamError(f"a scoring process died at start (exit code {slot.proc.exitcode})") from None
        if msg[0] != "ready":
            raise RlstreamError(f"a scoring process failed at start: {msg[1]}")
        slot.ready = True

    def _replace(self, i: int, why: str) -> None:
        old = self.slots[i]
        pid = old.proc.pid
        old.kill()
        self.killed += 1
        from consumers.reward.sandbox import sweep

        sweep(self.cfg.sandbox.uid_base + pid)
        log.warning("replaced a scoring process %s", kv(pid=pid, why=why))
        self.slots[i] = _Slot(self._ctx, self.cfg, self.log_level)

    def score(self, trajectories: list[dict]) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(trajectories)
        pending = deque(range(len(trajectories)))
        deaths: dict[int, int] = {}
        while pending or any(s.task for s in self.slots):
            for s in self.slots:
                if pending and s.ready and s.task is None:
                    idx = pending.popleft()
                    try:
                        s.conn.send((idx, trajectories[idx]))
                        s.task = (idx, time.monotonic())
                    except (BrokenPipeError, OSError):
                        pending.appendleft(idx)  # never started: retry it on the replacement
                        self._replace(self.slots.index(s), "pipe broken")
            now = time.monotonic()
            waits = [s.task[1] + self.timeout_s - now for s in self.slots if s.task]
            watch = [s.conn for s in self.slots if s.task or not s.ready]
            for conn in mp_wait(watch, timeout=max(0.0, min(waits, default=1.0))):
                i = next(k for k, s in enumerate(self.slots) if s.conn is conn)
                s = self.slots[i]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if not s.ready:
                        raise RlstreamError(f"a scoring process died at start (exit code {s.proc.exitcode})") from None
                    if s.task:
                        idx = s.task[0]
                        deaths[idx] = deaths.get(idx, 0) + 1
                        if deaths[idx] < 2:
                            pending.appendleft(idx)  # maybe not its fault: one more try
                        else:
                            results[idx] = Outcome(
                                False,
                                error_type="reward_error",
                                reason=f"scoring process died twice on it (exit code {s.proc.exitcode})",
                            )
                    self._replace(i, "died")
                    continue
                if msg[0] == "ready":
                    s.ready = True
                elif msg[0] == "failed":
                    raise RlstreamError(f"a scoring process failed at start: {msg[1]}")
                else:
                    idx, kind, payload, ms = msg
                    results[idx] = _outcome(kind, payload, ms)
                    s.task = None
            now = time.monotonic()
            for i, s in enumerate(self.slots):
                if s.task and now - s.task[1] >= self.timeout_s:
                    results[s.task[0]] = _timeout(self.timeout_s)
                    self._replace(i, "timeout")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for s in self.slots:
            try:
                s.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for s in self.slots:
            s.proc.join(5)
            s.kill()
        self.slots = []


# ---- threads ----------------------------------------------------------------------------------
class ThreadPool:
    def __init__(self, reward_cfg, size: int, timeout_s: float):
        self.router = TaskRouter(reward_cfg)
        self.size, self.timeout_s = size, timeout_s
        self.abandoned = 0

    def start(self) -> ThreadPool:
        return self

    def score(self, trajectories: list[dict]) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(trajectories)
        done: queue.Queue = queue.Queue()  # per batch: late results of abandoned calls go nowhere
        pending = deque(range(len(trajectories)))
        running: dict[int, float] = {}

        def run(idx: int) -> None:
            done.put((idx, *_call(self.router, trajectories[idx])))

        while pending or running:
            while pending and len(running) < self.size:
                idx = pending.popleft()
                running[idx] = time.monotonic()
                threading.Thread(target=run, args=(idx,), daemon=True, name=f"reward-{idx}").start()
            wait = min(running.values()) + self.timeout_s - time.monotonic()
            try:
                idx, kind, payload, ms = done.get(timeout=max(0.0, wait))
                if idx in running:
                    del running[idx]
                    results[idx] = _outcome(kind, payload, ms)
            except queue.Empty:
                pass
            now = time.monotonic()
            for idx, started in list(running.items()):
                if now - started >= self.timeout_s:
                    del running[idx]
                    results[idx] = _timeout(self.timeout_s)
                    self.abandoned += 1
        return results  # type: ignore[return-value]

    def close(self) -> None:
        pass


def make_pool(reward_cfg, log_level: str = "INFO"):
    """The pool the config asks for, started."""
    if reward_cfg.executor == "process":
        return ProcessPool(reward_cfg, reward_cfg.pool_size, reward_cfg.timeout_s, log_level).start()
    return ThreadPool(reward_cfg, reward_cfg.pool_size, reward_cfg.timeout_s).start()
