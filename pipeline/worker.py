"""One lifecycle for every role process (feed, rollout, reward, trainer): alive, or loudly dead.

A role subclasses ``Worker`` and fills in ``setup()``, ``run_once()``, ``finish()`` and
``close()``; ``Worker.run()`` does the rest, the same way for every role:

* **worker id** (``<host>-<pid>`` unless configured), the **resolved-config file** in the run
  dir, **dead-letter records** (``dead_letter``) and **start-up retries** (``startup_call``: transient
  Kafka errors retried with backoff until ``liveness.startup_timeout_s``);
* **signals**: the first SIGTERM/SIGINT sets ``stop``; the role finishes what it holds
  (``finish``), closes, and exits 0. One that arrives during ``setup`` (which may be waiting for a
  broker that is down) ends the setup at once (``StopRequested``), then closes and exits 0. A
  second signal exits at once (code 128 + signal);
* **watchdog**: a thread that expects a beat from every main-loop iteration within
  ``liveness.watchdog_s`` (or within the limit of a declared long ``section``, e.g. a training
  step). A role that misses it, or that is still running ``shutdown_timeout_s`` after a stop
  was asked for, is hung: every thread's stack goes to the log and the process exits with
  ``EXIT_HUNG``. librdkafka can block forever inside a call whatever timeout it is given (seen in
  ``send_offsets_to_transaction`` after a broker restart); a restart is safe by design, waiting is not.
  Python runs a signal handler only between bytecodes of the main thread, so a main thread inside a
  long native call (a training step on a slow CPU, a stuck client) would never see a SIGTERM: the
  watchdog learns of every signal itself, through ``signal.set_wakeup_fd``, and starts the stop
  bound (and exits at once on a second signal) even while the main thread cannot run the handler.

Signals and the watchdog are installed only when ``run`` is called on the main thread of a
process (the command line); in-process uses (tests, benchmarks) pass a ``stop`` event instead.

What this is not: a process supervisor (``rlstream.supervisor`` restarts what exits here).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from pipeline.config import write_resolved
from pipeline.kafka import retry_transient, wedged_clients
from pipeline.log import kv
from pipeline.records import dead_letter

log = logging.getLogger(__name__)
EXIT_HUNG = 75
"""Exit code of a role the watchdog declared hung (EX_TEMPFAIL: restart it)."""


class StopRequested(BaseException):
    """Raised in the main thread by a stop signal that arrives during ``setup``: start-up may be
    waiting (with retries) for Kafka, and a stop must not wait for that. A BaseException so that no
    ``except Exception`` in setup code catches it."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def die_with_parent() -> bool:
    """If started by a supervisor (``RLSTREAM_PARENT_PID``), get SIGTERM when it dies, even by
    ``kill -9`` (Linux ``PR_SET_PDEATHSIG``), and exit at once if it is already gone. Returns
    whether a supervisor started this process."""
    parent = os.environ.pop("RLSTREAM_PARENT_PID", None)  # not for our own children
    if not parent or not sys.platform.startswith("linux"):
        return bool(parent)
    import ctypes

    from pipeline.ports import pid_alive

    if os.getppid() == int(parent):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if not pid_alive(int(parent)):  # the supervisor died before the request took effect
        log.error("supervisor %s is gone; exiting", parent)
        os._exit(1)
    return True


def exit_without_teardown(code: int, why: str) -> None:
    """End the process now, after its output, skipping interpreter teardown: for a process whose
    work is done and whose native threads could block or abort during that teardown."""
    log.info("exiting without interpreter teardown %s", why)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(code)


STOPPED_GAP_S = 10.0
"""A watchdog tick (every 0.5 s) that came this much later means the process was stopped: the
time it stood still does not count against the main loop's limit."""


class Watchdog:
    """Kills the process, loudly, when its main loop stops beating or a stop takes too long."""

    def __init__(self, name: str, loop_s: float, shutdown_s: float, signals: socket.socket | None = None):
        self.name, self.loop_s, self.shutdown_s = name, loop_s, shutdown_s
        self._signals = signals
        """Read end of the signal wakeup socket (``signal.set_wakeup_fd``): one byte per signal."""
        self._seen = 0
        self._deadline = time.monotonic() + loop_s
        self._what = "main loop"
        self._stop_deadline: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self) -> None:
        self._what, self._deadline = "main loop", time.monotonic() + self.loop_s

    @contextlib.contextmanager
    def section(self, what: str, seconds: float):
        """Allow ``seconds`` for a declared long operation (then the loop's own limit again)."""
        prev = self._what, self._deadline
        self._what, self._deadline = what, time.monotonic() + seconds
        try:
            yield
        finally:
            self._what, self._deadline = prev[0], max(prev[1], time.monotonic() + self.loop_s)

    def stop_left(self) -> float | None:
        """Seconds left before a stop asked for is cut short (None: no stop asked for)."""
        return None if self._stop_deadline is None else self._stop_deadline - time.monotonic()

    def stopping(self) -> None:
        """A stop was asked for: the process must be gone within ``shutdown_s``."""
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.shutdown_s

    def close(self) -> None:
        self._done.set()

    def _wait(self, timeout: float) -> bool:
        """Sleep ``timeout`` (True once closed), taking note of the signals that arrive meanwhile."""
        if self._signals is None:
            return self._done.wait(timeout)
        import select

        if select.select([self._signals], [], [], timeout)[0]:
            try:
                data = self._signals.recv(64)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":  # the write end was closed (the run is over): plain waits from here
                self._signals.close()
                self._signals = None
            for signum in data or b"":
                self._signalled(signum)
        return self._done.is_set()

    def _signalled(self, signum: int) -> None:
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        self._seen += 1
        name = signal.Signals(signum).name
        if self._seen > 1:  # as the handler does on a second signal, for a main thread that cannot
            log.warning("second %s seen by the watchdog: exiting now %s", name, kv(worker=self.name))
            for h in logging.getLogger().handlers:
                with contextlib.suppress(Exception):
                    h.flush()
            os._exit(128 + signum)
        self.stopping()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._wait(0.5):
            now = time.monotonic()
            gap, last = now - last, now
            if gap > STOPPED_GAP_S:  # the whole process was stopped (SIGSTOP, a paused VM): no thread ran,
                self._deadline += gap  # so the time is not the loop's; a stop asked for keeps its bound
                log.warning("this process was stopped for %.0f s (SIGSTOP or a paused machine); going on %s",
                            gap, kv(worker=self.name, section=self._what))  # fmt: skip
            if self._stop_deadline is not None and now > self._stop_deadline:
                self._die(f"still running {self.shutdown_s:.0f} s after it was asked to stop (in {self._what})")
            if now > self._deadline:
                self._die(f"no progress in {self._what} within its limit")

    def _die(self, why: str) -> None:
        log.critical("%s is hung: %s; dumping every thread's stack and exiting %s", self.name, why, kv(code=EXIT_HUNG))
        for h in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                h.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        os._exit(EXIT_HUNG)


KEEPALIVE_S = 10.0
"""How often ``Worker.keepalive`` runs while the main loop is inside a declared section."""


class Worker:
    """Base of every role process. Subclasses set ``role`` and implement the hooks."""

    role = "worker"
    unit = "iteration"
    """What a stop lets finish, for the log line ("batch", "step", ...)."""
    stops_itself = False
    """True for roles whose ``run_once`` reads ``stop_event`` itself and returns False (e.g. a
    trainer whose ranks must agree on the step to stop at); else the loop checks it."""

    def __init__(self, cfg, worker_id: str | None = None):
        self.cfg = cfg
        self.liveness = cfg.liveness
        self.worker_id = worker_id or default_worker_id()
        self.stop_event = threading.Event()
        self.watchdog: Watchdog | None = None
        self.failed = False
        """Set when the run ends with an error (``close`` may then skip what cannot work)."""
        self._signals = 0
        self._started = False
        self._in_setup = False

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """Connect, load models, restore state (runs under the ``slow_op_s`` limit)."""

    def wait_turn(self) -> None:
        """Before ``setup``: wait until this process may run (a hot standby waits here for the
        active process to die). Must ``beat`` and raise ``StopRequested`` on a stop; no time limit."""

    def run_once(self) -> bool:
        """One iteration of the main loop; False when the role is done."""
        raise NotImplementedError

    def finish(self) -> None:
        """After a stop: hand over cleanly what is held (drain, flush, commit)."""

    def close(self) -> None:
        """Release every client and thread; called once, also after an error."""

    def result(self) -> Any:
        """What ``run`` returns."""
        return None

    def teardown_hazards(self) -> dict:
        """Why interpreter teardown is unsafe for this process after a clean ``run`` (empty: it is
        safe). A librdkafka client had to be abandoned (stuck in a call for good): destroying it at
        exit could block."""
        n = wedged_clients()
        return {"abandoned_kafka_clients": n} if n else {}

    # -- the lifecycle -------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the main loop to finish (thread-safe)."""
        self.stop_event.set()
        if self.watchdog is not None:
            self.watchdog.stopping()

    def run(self, stop: threading.Event | None = None) -> Any:
        """setup, ``run_once`` until done or stopped, ``finish``, ``close``. On the main thread
        this also installs the signal handlers and the watchdog."""
        if stop is not None:
            self.stop_event = stop
        supervised = threading.current_thread() is threading.main_thread()
        restore, wakeup = self._install_signals() if supervised else ((lambda: None), None)
        if supervised:
            self.watchdog = Watchdog(
                f"{self.role} {self.worker_id}", self.liveness.watchdog_s, self.liveness.shutdown_timeout_s, wakeup
            ).start()
        try:
            try:
                self.start()
            except StopRequested:
                log.info("stopped during setup %s", kv(role=self.role, worker=self.worker_id))
            else:
                while self.stops_itself or not self.stop_event.is_set():
                    self.beat()
                    if not self.run_once():
                        break
                with self.section("finish", self.liveness.shutdown_timeout_s):
                    self.finish()
        except BaseException:
            self.failed = True
            raise
        finally:
            try:
                with self.section("close", self.liveness.shutdown_timeout_s):
                    self.close()
            finally:
                restore()
                if self.watchdog is not None:
                    self.watchdog.close()
        hazards = self.teardown_hazards() if self.watchdog is not None else {}  # a process of its own
        if hazards:  # this process ends here, cleanly, after its output
            exit_without_teardown(0, kv(**hazards))
        return self.result()

    def start(self) -> None:
        """Run ``setup`` once (``run`` calls it; tests may call it first)."""
        if not self._started:
            self._started = True
            self.wait_turn()
            with self.section("setup", self.liveness.slow_op_s):
                self._in_setup = True
                try:
                    self.setup()
                finally:
                    self._in_setup = False

    def beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    def stop_time_left(self) -> float | None:
        """Seconds left of the stop bound once a stop was asked for (None: not stopping)."""
        if not self.stop_event.is_set():
            return None
        left = self.watchdog.stop_left() if self.watchdog is not None else None
        return self.liveness.shutdown_timeout_s if left is None else left

    def section(self, what: str, seconds: float | None = None):
        """Context manager: a declared long operation (``liveness.slow_op_s`` unless given). The
        watchdog holds it to that limit; meanwhile a role with a ``keepalive`` hook keeps calling it
        (from a thread, every ``KEEPALIVE_S``), so a supervisor that watches its metrics does not take
        a declared wait for a hang (a process stuck with the GIL held calls nothing: still caught)."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        inner = self.watchdog.section(what, seconds or self.liveness.slow_op_s)
        if type(self).keepalive is Worker.keepalive or self._in_setup:
            return inner
        return self._kept_alive(inner)

    def keepalive(self) -> None:
        """Called from a thread while the main loop is inside a declared ``section`` (e.g. publish
        metrics); must be thread-safe and quick. Default: nothing."""

    @contextlib.contextmanager
    def _kept_alive(self, inner):
        done = threading.Event()

        def loop():
            while not done.wait(KEEPALIVE_S):
                try:
                    self.keepalive()
                except Exception as exc:  # a missed beat is harmless; the section itself decides
                    log.warning("keepalive failed %s", kv(role=self.role, worker=self.worker_id, error=exc))

        t = threading.Thread(target=loop, name="keepalive", daemon=True)
        with inner:
            t.start()
            try:
                yield
            finally:
                done.set()
                t.join(KEEPALIVE_S)

    def _install_signals(self):
        def on_signal(signum, _frame):
            self._signals += 1
            name = signal.Signals(signum).name
            if self._signals > 1:
                log.warning("second %s: exiting now %s", name, kv(role=self.role, worker=self.worker_id))
                os._exit(128 + signum)
            if self._in_setup:
                log.info("%s during setup: stopping now %s", name, kv(role=self.role, worker=self.worker_id))
                self.stop()
                raise StopRequested(name)
            log.info("%s: stopping after the current %s %s", name, self.unit, kv(role=self.role, worker=self.worker_id))
            self.stop()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        read, write = socket.socketpair()
        for sock in (read, write):
            sock.setblocking(False)
        old_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)

        def restore():
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
            write.close()  # the read end stays with the watchdog thread until the process ends

        return restore, read

    # -- shared helpers ------------------------------------------------------------------------
    def startup_call(self, fn, what: str):
        """``fn()``, retrying transient Kafka errors until ``liveness.startup_timeout_s``."""
        return retry_transient(fn, self.liveness.startup_timeout_s, what)

    def write_resolved(self, name: str | None = None):
        """The resolved config, written to ``<run_dir>/<name>.resolved.toml``."""
        return write_resolved(self.cfg, self.cfg.run_dir, name or f"{self.role}-{self.worker_id}")

    def dead_letter(self, msg, error_type: str, reason: str) -> dict:
        return dead_letter(msg, error_type, reason, self.role, self.worker_id)
