"""Supervise the child processes of one run (the demo, ``rlstream run``, benchmarks): start each
with its own log file, notice at once when one exits, restart it with backoff (restarts are safe by
design: every role resumes from Kafka or its checkpoint), stop loudly on a crash loop, and stop
them all by PID.

Every start, exit (with its cause), injected signal, restart, hang and stop is an event: kept in
``Supervisor.events`` and appended to ``<log_dir>/events.jsonl`` as it happens. An exit is
``finished`` (exit 0 of a child that may finish), ``injected`` (after a signal sent with
``inject``, e.g. a fault run's kill -9: restarted at once and not counted towards the
crash-loop budget), ``hung`` (exit code 75 from a role's own watchdog, or ``declare_hung``),
``oom`` (killed by the kernel for going over the memory limit it runs under, ``limit_memory``,
said in one line), ``crash`` (any other non-zero exit) or ``exited`` (exit 0 of a child that should
keep running).

Children never outlive the supervisor: each is told the supervisor's PID (``RLSTREAM_PARENT_PID``)
and asks the kernel for SIGTERM when its parent dies (``pipeline.worker.die_with_parent``), so even
a supervisor killed with ``kill -9`` leaves no orphan behind.

With ``preload`` (a list of modules) or ``forks`` (a server the caller started earlier, with the
same environment), children are forked from a ``rlstream.forkserver`` that imported those modules once, instead of each importing them again: a job's roles start seconds
sooner on a small machine, and a restarted role is back at once. Any trouble with the server falls
back to plain processes.

It is not a cluster manager: every child runs on this machine and is killed with the run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import EXIT_CONFIG, RlstreamError
from pipeline.log import kv
from rlstream.forkserver import ForkedProc, ForkServer
from rlstream.memory_limit import MemoryLimit

log = logging.getLogger(__name__)
EXIT_HUNG = 75  # pipeline.worker.EXIT_HUNG: a role's watchdog found it hung


def _forked(proc) -> dict:
    """``forked: true`` in the events of a child forked by the fork server."""
    return {"forked": True} if isinstance(proc, ForkedProc) else {}


class ChildDied(RlstreamError):
    """A supervised process exited while the run still needed it (and may not be restarted)."""

    def __init__(self, name: str, code: int, log_tail: str, why: str = ""):
        self.name, self.code, self.log_tail = name, code, log_tail
        super().__init__(f"{name} exited with code {code}{why}; last lines of its log:\n{log_tail}")


class CrashLoop(ChildDied):
    """A child kept dying: more restarts than the policy allows within its window."""


@dataclass
class RestartPolicy:
    """Restart a dead (or hung) child at once the first time within ``window_s``, then after
    ``backoff_s`` doubling up to ``max_backoff_s`` (a restart is safe by design, and each second of a
    first restart is a second the pipeline waits); more than ``max_restarts`` restarts of one child
    within ``window_s`` is a crash loop."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | ForkedProc
    log_path: Path
    env: dict
    may_exit: bool = False  # True for processes that finish on their own (feed, trainer)
    started_at: float = field(default_factory=time.monotonic)
    restarts: deque = field(default_factory=deque)  # monotonic times of restarts
    restart_at: float | None = None  # pending restart (backoff)
    last_code: int | None = None
    expect: tuple[str, int] | None = None  # (cause, signal) of a signal we sent: its exit is no crash
    stop_deadline: float | None = None  # retiring (SIGTERM sent): SIGKILL after this
    memory: MemoryLimit | None = None  # the memory limit it runs under (and its restarts)

    def tail(self, lines: int = 20, skip_client_log: bool = False) -> str:
        """The last ``lines`` lines of the child's log (``skip_client_log``: without librdkafka's own
        lines, raw ``%<level>|...`` or through the ``librdkafka`` logger, which repeat every failed
        reconnect while a broker is away)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines(keepends=True)
        except OSError:
            return ""
        if skip_client_log:
            text = [line for line in text[-20 * lines :] if not line.startswith("%") and " librdkafka: " not in line]
        return "".join(text[-lines:])


class Supervisor:
    def __init__(
        self,
        log_dir: Path,
        env: dict[str, str] | None = None,
        restart: RestartPolicy | None = None,
        preload: list[str] | None = None,
        forks: ForkServer | None = None,
    ):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env if env is not None else os.environ)
        self.env["RLSTREAM_PARENT_PID"] = str(os.getpid())
        self.policy = restart
        self.children: dict[str, Child] = {}
        self.retiring: dict[str, Child] = {}
        self.restarts_total = 0
        self.events: list[dict] = []
        self.t0 = time.monotonic()
        self._events_path = self.log_dir / "events.jsonl"
        self._old_limits: list[MemoryLimit] = []  # replaced by another: removed at the end
        self.forks = forks  # started by the caller (its environment must be ``env``), or here
        if forks is None and preload is not None and sys.platform.startswith("linux"):
            self.forks = ForkServer(self.env, preload)
            log.info("fork server starting %s", kv(pid=self.forks.proc.pid, modules=len(preload)))
        if self.forks is not None:
            self.forks.log_path = self.log_dir / "forkserver.log"
            self.event("fork_server", "forkserver", pid=self.forks.proc.pid)

    def event(self, kind: str, name: str, **fields) -> dict:
        """Record one event (also appended to ``events.jsonl``) and return it."""
        ev = {"t": round(time.monotonic() - self.t0, 2), "time": round(time.time(), 3), "event": kind, "name": name}
        ev.update(fields)
        self.events.append(ev)
        try:
            with open(self._events_path, "a") as f:
                f.write(json.dumps(ev) + "\n")
        except OSError as exc:  # the in-memory list still has it
            log.warning("cannot append to the event log %s", kv(path=self._events_path, error=exc))
        return ev

    def _spawn(self, argv: list[str], log_path: Path, env: dict) -> subprocess.Popen | ForkedProc:
        if self.forks is not None and argv[:3] == [sys.executable, "-m", "rlstream"]:
            if (proc := self.forks.spawn(argv[3:], env, log_path)) is not None:
                return proc
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the supervisor, which stops children in order
            )

    def start(
        self, name: str, args: list[str], may_exit: bool = False, env: dict | None = None,
        memory_limit_mb: int | None = None,
    ) -> Child:  # fmt: skip
        """Start ``python -m rlstream <args>`` (or a full argv if it starts with '/'); with
        ``memory_limit_mb``, under that memory limit (``limit_memory``), its restarts too."""
        argv = args if args and os.path.isabs(args[0]) else [sys.executable, "-m", "rlstream", *args]
        log_path = self.log_dir / f"{name}.log"
        full_env = {**self.env, **(env or {})}
        child = Child(name, argv, self._spawn(argv, log_path, full_env), log_path, full_env, may_exit)
        self.children[name] = child
        self.event("start", name, pid=child.proc.pid, **_forked(child.proc))
        log.info("started %s", kv(name=name, pid=child.proc.pid, log=log_path))
        if memory_limit_mb:
            self.limit_memory(name, memory_limit_mb)
        return child

    def limit_memory(
        self, name: str, mb: int | None, restarts: bool = True, *, running: bool = True, until_oom: bool = False
    ) -> MemoryLimit | None:
        """Put a child under a memory limit of ``mb`` MB: a memory cgroup where one can be made (over
        it, the kernel's OOM killer kills it), else RLIMIT_AS (``rlstream.memory_limit``); the
        running process (``running``) and its restarts (``restarts``; ``until_oom``: only until one
        is killed for it). An exit it causes is said in one line (``<name> was killed by the kernel's
        OOM killer (memory limit N MB); restarting``) and restarted per the policy. ``mb`` None
        lifts the limit now, for the running child and its restarts."""
        c = self.children[name]
        if mb is None:
            if c.memory is not None:
                c.memory.lift()
                c.memory.restarts = False
            return None
        pid = c.proc.pid if running else None
        if c.memory is not None and c.memory.mb == mb:
            if pid is not None:
                c.memory.attach(pid)
        else:
            if c.memory is not None:
                c.memory.lift()
                self._old_limits.append(c.memory)
            c.memory = MemoryLimit.apply(pid, name, mb)
        c.memory.restarts, c.memory.until_oom = restarts, until_oom
        self.event("memory_limit", name, pid=pid, limit_mb=mb, how=c.memory.kind, restarts=restarts,
                   until_oom=until_oom)  # fmt: skip
        return c.memory

    def check(self) -> list[str]:
        """Handle exited children: return names that finished normally (exit 0, ``may_exit``);
        restart the others per the policy (none: raise ChildDied; too many: raise CrashLoop)."""
        finished = []
        now = time.monotonic()
        self._check_retiring(now)
        for c in self.children.values():
            if c.restart_at is not None:
                if now >= c.restart_at:
                    self._restart(c)
                continue
            code = c.proc.poll()
            if code is None:
                continue
            if c.may_exit and code == 0:  # done (also if it finished just before a signal we sent)
                c.expect = None
                if c.last_code != 0:  # once per finish: check() keeps reporting a finished child
                    c.last_code = 0
                    self.event("exit", c.name, pid=c.proc.pid, code=0, cause="finished")
                finished.append(c.name)
            else:
                self._died(c, code, now)
                if c.restart_at is not None and c.restart_at <= now:  # no backoff: now, not next check
                    self._restart(c)
        return finished

    def _died(self, c: Child, code: int, now: float, why: str = "") -> None:
        injected = c.expect is not None and (code == -c.expect[1] or c.expect[1] != signal.SIGKILL)
        limited = c.memory is not None and c.memory.pid == c.proc.pid  # this process ran under it
        oom = c.memory.why_dead(code, c.tail(40)) if limited and not why else None
        if injected:
            cause = f"injected: {c.expect[0]}"
        elif why:
            cause = "hung"
        elif oom:
            cause, why = "oom", f" ({oom})"
            if c.memory.until_oom:  # killed for it: the restart runs without it
                c.memory.lift()
                c.memory.restarts = False
        else:
            cause = "hung" if code == EXIT_HUNG else ("crash" if code != 0 else "exited")
        c.expect = None
        self.event(
            "exit", c.name, pid=c.proc.pid, code=code, cause=cause, why=oom or why.strip(" ()") or None,
            **({} if injected else {"log_tail": c.tail(80, skip_client_log=True)}),
        )  # fmt: skip
        if self.policy is None:
            raise ChildDied(c.name, code, c.tail(), why)
        if code == EXIT_CONFIG and not injected:  # a mistake in its config: a restart cannot mend it
            raise ChildDied(c.name, code, c.tail(), " (a configuration error: not restarted)")
        if injected:  # our own fault injection: a first death each time, no crash-loop budget spent
            c.last_code, c.restart_at = code, now
            log.info("child killed by us; restarting %s", kv(name=c.name, code=code, cause=cause))
            with open(c.log_path, "a") as f:
                f.write(f"\n[supervisor] {c.name} exited with code {code} ({cause}); restart now\n")
            return
        while c.restarts and now - c.restarts[0] > self.policy.window_s:
            c.restarts.popleft()
        if len(c.restarts) >= self.policy.max_restarts:
            self.event("crash_loop", c.name, code=code, restarts=len(c.restarts), window_s=self.policy.window_s)
            raise CrashLoop(
                c.name, code, c.tail(40), f"{why}; {len(c.restarts)} restarts within {self.policy.window_s:.0f} s"
            )
        n = len(c.restarts)  # the first death in the window: no backoff
        delay = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (n - 1)) if n else 0.0
        c.restarts.append(now)
        c.last_code, c.restart_at = code, now + delay
        if oom:  # the one line that says it
            log.warning("%s; restarting %s", oom, kv(code=code, in_s=delay, restarts=len(c.restarts)))
        log.warning(
            "child died; restarting %s",
            kv(name=c.name, code=code, why=why or "-", in_s=delay, restarts=len(c.restarts)),
        )
        with open(c.log_path, "a") as f:
            f.write(f"\n[supervisor] {c.name} exited with code {code}{why}; restart in {delay:.1f} s\n")

    def _restart(self, c: Child) -> None:
        c.restart_at = None
        c.proc = self._spawn(c.argv, c.log_path, c.env)
        c.started_at = time.monotonic()
        if c.memory is not None and c.memory.restarts:
            try:
                c.memory.attach(c.proc.pid)
            except OSError as exc:  # the cgroup went away: the role runs on, without the limit
                log.warning("could not put a restarted role under its memory limit %s", kv(name=c.name, error=exc))
        self.restarts_total += 1
        self.event("restart", c.name, pid=c.proc.pid, restarts=len(c.restarts), **_forked(c.proc))
        log.info("restarted %s", kv(name=c.name, pid=c.proc.pid, restarts=len(c.restarts)))

    def declare_hung(self, name: str, why: str) -> None:
        """Kill a child that stopped making progress (SIGKILL) and restart it per the policy."""
        c = self.children[name]
        c.expect = None  # whatever we sent before, this one is hung
        if c.proc.poll() is None:
            os.kill(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
        self._died(c, c.proc.returncode, time.monotonic(), f" (hung: {why})")

    def name_of(self, pid: int | None) -> str | None:
        """The name of the running child with this PID (None: no such child)."""
        return next((n for n, c in self.children.items() if pid is not None and c.proc.pid == pid), None)

    def inject(self, name: str, sig: int = signal.SIGKILL, cause: str = "kill -9") -> int | None:
        """Send ``sig`` to a running child as a deliberate fault: its exit is recorded as ``injected``
        (not a crash) and it is restarted at the policy's base backoff without spending its
        crash-loop budget. Returns the PID signalled, or None if the child is not running now."""
        c = self.children.get(name)
        if c is None or c.restart_at is not None or c.expect is not None or c.proc.poll() is not None:
            return None  # not running, or a signal of ours is already on its way
        c.expect = (cause, sig)
        os.kill(c.proc.pid, sig)
        self.event("signal", name, pid=c.proc.pid, signal=signal.Signals(sig).name, cause=cause)
        return c.proc.pid

    def retire(self, name: str, timeout: float, cause: str = "retired") -> int | None:
        """Stop a child for good without waiting here: SIGTERM now; ``check`` records its exit, or
        SIGKILLs it ``timeout`` s later (a ``stop_timeout`` event). Returns the PID, or None."""
        c = self.children.get(name)
        if c is None or c.restart_at is not None or c.proc.poll() is not None:
            return None
        del self.children[name]
        c.stop_deadline = time.monotonic() + timeout
        c.expect = (cause, signal.SIGTERM)
        os.kill(c.proc.pid, signal.SIGTERM)
        self.event("signal", name, pid=c.proc.pid, signal="SIGTERM", cause=cause)
        self.retiring[name] = c
        return c.proc.pid

    def _check_retiring(self, now: float) -> None:
        for name, c in list(self.retiring.items()):
            code = c.proc.poll()
            if code is None and now < c.stop_deadline:
                continue
            if code is None:
                self._force_stop(c, c.stop_deadline - now)
            else:
                self.event("stopped", name, pid=c.proc.pid, code=code, cause=c.expect[0] if c.expect else "stop")
            del self.retiring[name]

    def _force_stop(self, c: Child, waited: float) -> None:
        log.warning("child did not stop in time; killing %s", kv(name=c.name, pid=c.proc.pid))
        tail = c.tail(80, skip_client_log=True)
        try:
            os.kill(c.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        c.proc.wait()
        self.event("stop_timeout", c.name, pid=c.proc.pid, code=c.proc.returncode, waited_s=round(waited, 1),
                   log_tail=tail)  # fmt: skip

    def restarts(self) -> dict[str, int]:
        return {n: len(c.restarts) for n, c in self.children.items() if c.restarts}

    def alive(self, name: str) -> bool:
        c = self.children.get(name)
        return c is not None and c.restart_at is None and c.proc.poll() is None

    def stop(self, name: str, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int | None:
        c = self.children.pop(name, None)
        if c is None:
            return None
        if c.proc.poll() is None:
            try:
                os.kill(c.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                c.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._force_stop(c, timeout)
                return c.proc.returncode
            self.event("stopped", name, pid=c.proc.pid, code=c.proc.returncode, cause="stop")
        return c.proc.returncode

    def kill9(self, name: str) -> None:
        """SIGKILL one child (fault injection in tests and benchmarks) and forget it."""
        c = self.children.pop(name)
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        self.event("killed", name, pid=c.proc.pid, code=c.proc.returncode, cause="kill9")

    def stop_all(self, timeout: float = 40.0) -> dict[str, int | None]:
        """SIGTERM everyone first (so they shut down in parallel), then wait, then SIGKILL."""
        limits = [c.memory for c in (*self.children.values(), *self.retiring.values()) if c.memory is not None]
        limits += self._old_limits
        running = set()
        for c in self.children.values():
            if c.proc.poll() is None:
                try:
                    os.kill(c.proc.pid, signal.SIGTERM)
                    running.add(c.name)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        codes = {}
        for name in list(self.children):
            c = self.children[name]
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._force_stop(c, timeout)
            else:
                if name in running:
                    self.event("stopped", name, pid=c.proc.pid, code=c.proc.returncode, cause="stop_all")
            codes[name] = c.proc.returncode
        self.children.clear()
        for name, c in list(self.retiring.items()):  # retired earlier, not gone yet
            try:
                c.proc.wait(max(0.1, c.stop_deadline - time.monotonic()))
                self.event("stopped", name, pid=c.proc.pid, code=c.proc.returncode, cause=c.expect[0])
            except subprocess.TimeoutExpired:
                self._force_stop(c, timeout)
            codes[name] = c.proc.returncode
        self.retiring.clear()
        for limit in limits:  # every process under it is gone
            limit.close()
        if self.forks is not None:
            self.forks.close()
        return codes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()
