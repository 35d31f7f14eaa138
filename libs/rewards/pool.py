"""Score a batch of trajectories in parallel, each call under a wall-time limit.

Both pools keep ``size`` long-lived *lanes* (scorers) and stream work to them: a lane holds up to
``depth`` trajectories in flight, sent as one chunk, scores them in order and answers each as it
finishes; the pool tops a thread lane up when it falls to half, a process lane when it is empty
(a chunk may not fit the pipe's buffer, and a send must never wait behind a hung call). So a
light reward costs no round trip (nor thread start) per record, and a slow one still keeps every
lane busy. Deadlines stay per
call: the head of a lane started when the lane received it or when the lane answered the call
before it, whichever is later; a head past ``timeout_s`` is a ``reward_timeout``, its lane is
replaced, and the calls queued behind it go back to the pending work (they never started).

``ProcessPool`` lanes are spawned processes, each holding its own TaskRouter built from the reward
config, so scoring never shares the worker's GIL (the default, ``reward.executor = "process"``).
A lane past its deadline is SIGKILLed (and, as root, the sandbox uid of that process swept), then
replaced. A process that dies mid-call is replaced and the call retried once; a second death
fails only that call.
``ThreadPool`` lanes are threads of the worker itself: cheapest for light rewards, but a call past
its deadline is abandoned, not stopped (Python cannot kill a thread).

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

from libs.rewards.base import TaskRouter
from libs.rewards.config import scoring_part
from pipeline.errors import ConfigError, RlstreamError
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
        term = getattr(exc, "reward_term", None)
        out = ("error", (f"{type(exc).__name__}: {exc}" + (f" (in reward {term!r})" if term else ""))[:2000])
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


# ---- lanes (shared by both pools) -------------------------------------------------------------
DEPTH = 16
"""Most trajectories in flight per lane; a lane gets its next chunk at ``refill_at`` or fewer."""


class _Lane:
    """One scorer with trajectories in flight, answered in order."""

    refill_at = DEPTH // 2
    """Send the next chunk when this many or fewer are in flight."""

    def __init__(self):
        self.ready = False
        self.inflight: deque[int] = deque()  # indexes sent and not answered, in order
        self.since = 0.0  # when the head of ``inflight`` started (monotonic)

    def send(self, items: list[tuple[int, dict]]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def kill(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class _LanePool:
    """The scheduling both pools share: chunks out, answers in, per-call deadlines, replacement.
    A subclass provides ``_new_lane()``, ``_wait(timeout) -> [(lane, event)]`` and ``_on_replace``."""

    lanes: list
    timeout_s: float

    def _new_lane(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _wait(self, timeout: float) -> list[tuple[object, tuple]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _on_replace(self, lane, why: str) -> None:
        pass

    def _started(self, lane, event: tuple) -> bool:
        """Handle a lane's start-up event ("ready", "failed", or "died" before it was ready);
        False for any other event."""
        if event[0] == "ready":
            lane.ready = True
        elif event[0] == "failed":  # a reward that cannot be built stays a ConfigError: not worth a restart
            raise (ConfigError if event[2:] and event[2] else RlstreamError)(f"a scorer failed at start: {event[1]}")
        elif event[0] == "died" and not lane.ready:
            raise RlstreamError(f"a scoring process died at start ({event[1]})")
        else:
            return False
        return True

    def _replace(self, i: int, why: str) -> None:
        old = self.lanes[i]
        old.kill()
        self._on_replace(old, why)
        self.lanes[i] = self._new_lane()

    def score(self, trajectories: list[dict]) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(trajectories)
        pending = deque(range(len(trajectories)))
        deaths: dict[int, int] = {}

        def requeue(lane) -> None:  # calls queued behind the head never started: send them again
            pending.extendleft(reversed(lane.inflight))
            lane.inflight.clear()

        while pending or any(lane.inflight for lane in self.lanes):
            now = time.monotonic()
            for i, lane in enumerate(self.lanes):
                if not (pending and lane.ready and len(lane.inflight) <= lane.refill_at):
                    continue
                share = -(-len(pending) // len(self.lanes))  # spread a small batch over every lane
                take = [pending.popleft() for _ in range(min(DEPTH - len(lane.inflight), share))]
                try:
                    lane.send([(idx, trajectories[idx]) for idx in take])
                except (BrokenPipeError, OSError):
                    pending.extendleft(reversed(take))  # never started: retry them on the replacement
                    requeue(lane)
                    self._replace(i, "pipe broken")
                    continue
                if not lane.inflight:
                    lane.since = now
                lane.inflight.extend(take)
            waits = [lane.since + self.timeout_s - now for lane in self.lanes if lane.inflight]
            for lane, event in self._wait(max(0.0, min(waits, default=1.0))):
                i = self.lanes.index(lane) if lane in self.lanes else -1
                if i < 0:
                    continue  # an answer from a lane replaced meanwhile (an abandoned thread)
                if self._started(lane, event):
                    continue
                if event[0] == "died":
                    if lane.inflight:
                        idx = lane.inflight.popleft()
                        deaths[idx] = deaths.get(idx, 0) + 1
                        if deaths[idx] < 2:
                            pending.appendleft(idx)  # maybe not its fault: one more try
                        else:
                            results[idx] = Outcome(
                                False,
                                error_type="reward_error",
                                reason=f"scoring process died twice on it ({event[1]})",
                            )
                    requeue(lane)
                    self._replace(i, "died")
                else:
                    idx, kind, payload, ms = event
                    if lane.inflight and lane.inflight[0] == idx:
                        lane.inflight.popleft()
                        lane.since = time.monotonic()
                        results[idx] = _outcome(kind, payload, ms)
            now = time.monotonic()
            for i, lane in enumerate(self.lanes):
                if lane.inflight and now - lane.since >= self.timeout_s:
                    results[lane.inflight.popleft()] = _timeout(self.timeout_s)
                    requeue(lane)
                    self._replace(i, "timeout")
        return results  # type: ignore[return-value]


# ---- processes --------------------------------------------------------------------------------
def _child_main(conn, reward_cfg_json: dict, log_level: str) -> None:
    from libs.rewards.config import ScoringConfig
    from pipeline.log import setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle
    setup_logging(log_level)
    try:
        router = TaskRouter(ScoringConfig.model_validate(reward_cfg_json))
        if router.uses("math"):
            from libs.rewards.builtin import _math_verify

            _math_verify()  # import math-verify now, not inside the first call's deadline
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}", isinstance(exc, ConfigError)))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # the worker is gone
            return
        if chunk is None:
            return
        for idx, traj in chunk:
            kind, payload, ms = _call(router, traj)
            try:
                conn.send((idx, kind, payload, ms))
            except (BrokenPipeError, OSError):
                return


class _ProcessLane(_Lane):
    refill_at = 0
    """A chunk (up to DEPTH x ~10 KB) can exceed the pipe's buffer: send only to a process that has
    answered everything, so it is reading and the send cannot block behind a hung call."""

    def __init__(self, ctx, reward_cfg, log_level: str):
        super().__init__()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(child, scoring_part(reward_cfg).model_dump(mode="json"), log_level), daemon=True
        )
        self.proc.start()
        child.close()

    def send(self, items: list[tuple[int, dict]]) -> None:
        self.conn.send(items)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()


class ProcessPool(_LanePool):
    def __init__(self, reward_cfg, size: int, timeout_s: float, log_level: str = "INFO"):
        self.cfg, self.size, self.timeout_s, self.log_level = reward_cfg, size, timeout_s, log_level
        self._ctx = mp.get_context("spawn")  # never fork a process that runs librdkafka threads
        self.lanes: list[_ProcessLane] = []
        self.killed = 0

    @property
    def slots(self) -> list[_ProcessLane]:
        return self.lanes

    def _new_lane(self) -> _ProcessLane:
        return _ProcessLane(self._ctx, self.cfg, self.log_level)

    def start(self, timeout_s: float = 120.0) -> ProcessPool:
        self.lanes = [self._new_lane() for _ in range(self.size)]
        deadline = time.monotonic() + timeout_s
        while not all(lane.ready for lane in self.lanes):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RlstreamError("a scoring process did not start in time")
            for lane, event in self._wait(left):
                self._started(lane, event)
        return self

    def _on_replace(self, lane, why: str) -> None:
        from libs.rewards.sandbox import sweep

        self.killed += 1
        sweep(self.cfg.sandbox.uid_base + lane.proc.pid)
        log.warning("replaced a scoring process %s", kv(pid=lane.proc.pid, why=why))

    def _wait(self, timeout: float) -> list[tuple[object, tuple]]:
        """Every message the lanes have sent (drained, so a chunk's answers cost one wake-up)."""
        out = []
        for conn in mp_wait([lane.conn for lane in self.lanes], timeout=timeout):
            lane = next(x for x in self.lanes if x.conn is conn)
            try:
                while True:
                    out.append((lane, conn.recv()))
                    if not conn.poll(0):
                        break
            except (EOFError, OSError):
                out.append((lane, ("died", f"exit code {lane.proc.exitcode}")))
        return out

    def close(self) -> None:
        for lane in self.lanes:
            try:
                lane.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for lane in self.lanes:
            lane.proc.join(5)
            lane.kill()
        self.lanes = []


# ---- threads ----------------------------------------------------------------------------------
class _ThreadLane(_Lane):
    """A daemon thread scoring the chunks put on its queue; abandoned (not stopped) when replaced."""

    def __init__(self, router, answers: queue.Queue, n: int):
        super().__init__()
        self.ready = True
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(router, answers), daemon=True, name=f"reward-{n}")
        self.thread.start()

    def _run(self, router, answers: queue.Queue) -> None:
        while (chunk := self.inbox.get()) is not None:
            for idx, traj in chunk:
                answers.put((self, (idx, *_call(router, traj))))

    def send(self, items: list[tuple[int, dict]]) -> None:
        self.inbox.put(items)

    def kill(self) -> None:
        self.inbox.put(None)  # ends it after its current call, if that call ever returns


class ThreadPool(_LanePool):
    def __init__(self, reward_cfg, size: int, timeout_s: float):
        self.router = TaskRouter(reward_cfg)
        self.size, self.timeout_s = size, timeout_s
        self.abandoned = 0
        self._answers: queue.Queue = queue.Queue()
        self._made = 0
        self.lanes = [self._new_lane() for _ in range(size)]

    def _new_lane(self) -> _ThreadLane:
        self._made += 1
        return _ThreadLane(self.router, self._answers, self._made)

    def start(self) -> ThreadPool:
        return self

    def _on_replace(self, lane, why: str) -> None:
        self.abandoned += 1
        log.warning("abandoned a scoring thread %s", kv(thread=lane.thread.name, why=why))

    def _wait(self, timeout: float) -> list[tuple[object, tuple]]:
        try:
            out = [self._answers.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._answers.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        for lane in self.lanes:
            lane.kill()
        self.lanes = []


def make_pool(reward_cfg, log_level: str = "INFO"):
    """The pool the config asks for, started."""
    if reward_cfg.executor == "process":
        return ProcessPool(reward_cfg, reward_cfg.pool_size, reward_cfg.timeout_s, log_level).start()
    return ThreadPool(reward_cfg, reward_cfg.pool_size, reward_cfg.timeout_s).start()
