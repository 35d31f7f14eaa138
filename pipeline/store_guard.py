"""Riding out storage faults: a full disk, a slow store, a store that fails for a while.

``StoreGuard.call(fn, what, where, need_bytes, cleanup)`` runs one write (published weights, the
trainer's own checkpoint, its steps log and pointer) and, when it fails for a storage reason,
removes what it half-wrote (``cleanup``), says so on screen through ``WorkerMetrics.set_fault``
and tries again with backoff, each wait a declared section of the role's watchdog (so a pause is
not taken for a hang) while its metrics go on being published, until it succeeds (the fault
is then cleared: ``resumed after N s``) or its bound is spent (then one loud ``StorageFault``):

* **disk full** (``ENOSPC``/``EDQUOT``, or any error of a write into a local directory whose disk
  has less than ``need_bytes`` free: torch's writer does not keep the errno):
  ``disk full at <dir> (need N MB free, M MB left); paused``. While it waits the free space is
  checked every second, so the write is tried again as soon as enough was freed. Bound:
  ``liveness.disk_full_timeout_s`` (0: wait as long as it takes).
* **failing store** (any other ``OSError``: an I/O error, a timeout of an object store):
  ``weights store failing at <dir>: <error>; retrying``. Bound: ``liveness.outage_s``.
* **slow store**: a write still running after ``liveness.store_slow_s`` is said while it lasts
  (``weights store slow: <what> at <dir> has taken over N s``); the watchdog still bounds it
  (``liveness.slow_op_s``).

A stop asked for while paused ends the wait with ``StorageFault``: what was not written is not
committed, and a restart does it again (the delivery guarantees hold, as after kill -9).

What this is not: the order of a role's writes (the trainer's checkpoint protocol), nor the store
itself (``pipeline.checkpoint``); errors that are not about storage (a bug, a bad tensor) and
user mistakes (permission denied, a path that is a file) pass through at once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable

from pipeline.errors import RlstreamError
from pipeline.log import kv

log = logging.getLogger(__name__)

MB = 1 << 20
BACKOFF_S = 1.0
"""Seconds before the second try (doubling at each further try, up to ``BACKOFF_MAX_S``)."""
BACKOFF_MAX_S = 15.0
"""The longest wait between two tries (a freed disk is noticed within a second regardless)."""
NOT_STORAGE = (PermissionError, IsADirectoryError, NotADirectoryError)
"""OSErrors that are a user's mistake, not a storage fault: never retried."""


class StorageFault(RlstreamError):
    """A write could not be done within its bound (or a stop came while it waited)."""


def is_disk_full(exc: BaseException) -> bool:
    """The error is the disk (or the user's quota) being full."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def local_dir(where: str) -> str | None:
    """The local directory ``where`` names (a path or ``file://`` URI), else None (an object store)."""
    if where.startswith("file://"):
        return where[len("file://") :]
    return None if "://" in where or "::" in where else where


def free_bytes(where: str) -> int | None:
    """Bytes free on the disk holding ``where`` (its nearest existing ancestor); None for a remote store."""
    path = local_dir(where)
    if path is None:
        return None
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def tree_bytes(path: str) -> int:
    """Bytes of every file under the local directory ``path`` (0 if it is not there)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def _mb(n: int) -> str:
    return f"{max(0, n) / MB:.0f} MB" if n >= MB or n <= 0 else f"{n / MB:.1f} MB"


class SlowWatch:
    """Says a write that has run past ``limit`` seconds (``say(text)``), from one daemon thread
    that lives as long as the process: a write costs a lock and a flag, not a thread. The thread
    sleeps until the write it watches is due; a write that ends sooner is found ended when it
    wakes, and the next one is watched from there (a write started while it is idle wakes it)."""

    def __init__(self, limit: float, say: Callable[[str | None], None]):
        self.limit, self.say = limit, say
        self._cond = threading.Condition()
        self._current: tuple | None = None  # (what, where, started, said) of the write in progress
        self._idle = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, what: str, where: str):
        """Around one write; yields an Event set once the write was said to be slow."""
        said = threading.Event()
        with self._cond:
            self._current = (what, where, time.monotonic(), said)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="store-slow", daemon=True)
                self._thread.start()
            elif self._idle:
                self._cond.notify()
        try:
            yield said
        finally:
            with self._cond:
                self._current = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._current is None:
                    self._idle = True
                    self._cond.wait()
                self._idle = False
                current = self._current
                what, where, started, said = current
                left = started + self.limit - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                # said under the lock: the write's end (which clears what was said) comes after it
                said.set()
                self.say(f"weights store slow: {what} at {where} has taken over {self.limit:.0f} s")
                while self._current is current:  # wait for the next write
                    self._cond.wait(1.0)


class StoreGuard:
    """Runs a role's writes through storage faults (see the module doc). ``worker``: the role
    (``pipeline.worker.Worker``), read at each use: its ``metrics`` (``WorkerMetrics``, or None:
    the log only), its ``section`` (each try, and each wait, is a declared operation for its
    watchdog) and its ``stop_event``. Without one: the log only, no watchdog."""

    def __init__(self, liveness=None, worker=None):
        if liveness is None:
            from pipeline.config import LivenessConfig

            liveness = LivenessConfig()
        self.liveness, self.worker = liveness, worker
        self.paused_s = 0.0
        """Seconds this guard has spent waiting on faults, in all."""
        self._slow: SlowWatch | None = None

    @property
    def metrics(self):
        return getattr(self.worker, "metrics", None)

    def section(self, what: str, seconds: float | None = None):
        return self.worker.section(what, seconds) if self.worker is not None else contextlib.nullcontext()

    @property
    def stop(self) -> threading.Event:
        return self.worker.stop_event if self.worker is not None else threading.Event()

    # -- saying it -------------------------------------------------------------------------------
    def _say(self, text: str | None) -> None:
        if self.metrics is not None:
            self.metrics.set_fault(text)
        elif text:
            log.warning("%s", text)

    @contextlib.contextmanager
    def _slow_watch(self, what: str, where: str):
        """Say the store is slow if the write is still running after ``liveness.store_slow_s``
        (``SlowWatch``: one thread for all of this guard's writes, not one per write)."""
        if self._slow is None:
            self._slow = SlowWatch(self.liveness.store_slow_s, self._say)
        with self._slow.watch(what, where) as said:
            yield said

    # -- the call ----------------------------------------------------------------------------------
    def call(
        self,
        fn: Callable,
        what: str,
        where: str,
        need_bytes: int | Callable[[], int] = 0,
        cleanup: Callable | None = None,
    ):
        """``fn()``, through storage faults; its result. ``what``: the write, for messages ("writing
        weights v3"); ``where``: the directory or URI it writes to; ``need_bytes``: about how much it
        writes, or a function that tells it, called only after a failure (a full disk is said with
        it, and the wait ends once that much is free); ``cleanup``: removes what a failed try left
        (called after each failure, its own errors logged)."""
        t0, tries, said = time.monotonic(), 0, None
        while True:
            tries += 1
            slow = None
            try:
                with self.section(what), self._slow_watch(what, where) as slow:
                    result = fn()
            except Exception as exc:
                if callable(need_bytes):
                    need_bytes = need_bytes()
                full = is_disk_full(exc) or self._short_of_space(exc, where, need_bytes)
                if not full and (not isinstance(exc, OSError) or isinstance(exc, NOT_STORAGE)):
                    if said or (slow is not None and slow.is_set()):
                        self._say(None)
                    raise
                if cleanup is not None:
                    try:
                        cleanup()
                    except Exception as cexc:
                        log.warning("could not remove a failed write %s", kv(what=what, error=cexc))
                if said is None or said.startswith("disk full") != full:  # the same fault keeps its first line
                    said = self._fault_text(exc, full, where, need_bytes)
                self._wait(said, full, exc, what, where, need_bytes, t0, tries)
                continue
            if said or (slow is not None and slow.is_set()):
                self._say(None)
            if said:
                log.info("storage fault over %s", kv(what=what, where=where, tries=tries,
                                                      paused_s=round(time.monotonic() - t0, 1)))  # fmt: skip
            return result

    def _short_of_space(self, exc: BaseException, where: str, need_bytes: int) -> bool:
        """A write error without an errno (torch's writer) into a local disk that is short of space."""
        if isinstance(exc, OSError) and exc.errno is not None:
            return False
        free = free_bytes(where)
        return free is not None and free < max(need_bytes, MB)

    @staticmethod
    def _fault_text(exc: BaseException, full: bool, where: str, need_bytes: int) -> str:
        if full:
            free = free_bytes(where)
            left = f", {_mb(free)} left" if free is not None else ""
            return f"disk full at {local_dir(where) or where} (need {_mb(max(need_bytes, MB))} free{left}); paused"
        err = (str(exc).splitlines() or [type(exc).__name__])[0]
        return f"weights store failing at {where}: {type(exc).__name__}: {err}; retrying"

    def _wait(self, text, full, exc, what, where, need_bytes, t0, tries) -> None:
        """Say ``text``, then wait out the backoff (beating the watchdog, noticing freed space and
        a stop); ``StorageFault`` once the fault's bound is spent."""
        elapsed = time.monotonic() - t0
        bound, key = (
            (self.liveness.disk_full_timeout_s, "liveness.disk_full_timeout_s")
            if full
            else (self.liveness.outage_s, "liveness.outage_s")
        )
        if bound and elapsed > bound:
            self._say(None)
            raise StorageFault(
                f"{text.rsplit(';', 1)[0]}: {what} failed for {elapsed:.0f} s ({tries} tries), past {key}={bound:g}; "
                "giving up (free space or fix the store, then the job resumes from its last checkpoint)"
            ) from exc
        if self.stop.is_set():
            self._say(None)
            raise StorageFault(f"stopped while waiting: {text.rsplit(';', 1)[0]}; {what} was not done") from exc
        self._say(text)
        log.warning("storage fault %s", kv(what=what, where=where, tries=tries, error=exc))
        delay = min(BACKOFF_S * 2 ** (tries - 1), BACKOFF_MAX_S)
        w0 = time.monotonic()
        end = w0 + delay
        with self.section(f"paused: {what}", delay + self.liveness.watchdog_s):  # the watchdog knows
            while time.monotonic() < end:
                if self.metrics is not None:
                    self.metrics.maybe_publish()
                if self.stop.wait(min(1.0, max(0.0, end - time.monotonic()))):
                    break
                if full:
                    free = free_bytes(where)
                    if free is not None and free >= max(need_bytes, MB):
                        break  # space was freed: try again now
        self.paused_s += time.monotonic() - w0
