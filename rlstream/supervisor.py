"""Supervise the child processes of one run (the demo, ``rlstream run``, benchmarks): start each
with its own log file, notice at once when one exits, restart it with backoff (restarts are safe by
design: every role resumes from Kafka or its checkpoint), stop loudly on a crash loop, and stop
them all by PID.

Children never outlive the supervisor: each is told the supervisor's PID (``RLSTREAM_PARENT_PID``)
and asks the kernel for SIGTERM when its parent dies (``pipeline.worker.die_with_parent``), so even
a supervisor killed with ``kill -9`` leaves no orphan behind.

It is not a cluster manager: every child runs on this machine and is killed with the run.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import RlstreamError
from pipeline.log import kv

log = logging.getLogger(__name__)


class ChildDied(RlstreamError):
    """A supervised process exited while the run still needed it (and may not be restarted)."""

    def __init__(self, name: str, code: int, log_tail: str, why: str = ""):
        self.name, self.code, self.log_tail = name, code, log_tail
        super().__init__(f"{name} exited with code {code}{why}; last lines of its log:\n{log_tail}")


class CrashLoop(ChildDied):
    """A child kept dying: more restarts than the policy allows within its window."""


@dataclass
class RestartPolicy:
    """Restart a dead (or hung) child after ``backoff_s`` doubling up to ``max_backoff_s``; more than
    ``max_restarts`` restarts of one child within ``window_s`` is a crash loop."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen
    log_path: Path
    env: dict
    may_exit: bool = False  # True for processes that finish on their own (feed, trainer)
    started_at: float = field(default_factory=time.monotonic)
    restarts: deque = field(default_factory=deque)  # monotonic times of restarts
    restart_at: float | None = None  # pending restart (backoff)
    last_code: int | None = None

    def tail(self, lines: int = 20) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""


class Supervisor:
    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, restart: RestartPolicy | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env if env is not None else os.environ)
        self.env["RLSTREAM_PARENT_PID"] = str(os.getpid())
        self.policy = restart
        self.children: dict[str, Child] = {}
        self.restarts_total = 0

    def _spawn(self, argv: list[str], log_path: Path, env: dict) -> subprocess.Popen:
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the supervisor, which stops children in order
            )

    def start(self, name: str, args: list[str], may_exit: bool = False, env: dict | None = None) -> Child:
        """Start ``python -m rlstream <args>`` (or a full argv if it starts with '/')."""
        argv = args if args and os.path.isabs(args[0]) else [sys.executable, "-m", "rlstream", *args]
        log_path = self.log_dir / f"{name}.log"
        full_env = {**self.env, **(env or {})}
        child = Child(name, argv, self._spawn(argv, log_path, full_env), log_path, full_env, may_exit)
        self.children[name] = child
        log.info("started %s", kv(name=name, pid=child.proc.pid, log=log_path))
        return child

    def check(self) -> list[str]:
        """Handle exited children: return names that finished normally (exit 0, ``may_exit``);
        restart the others per the policy (none: raise ChildDied; too many: raise CrashLoop)."""
        finished = []
        now = time.monotonic()
        for c in self.children.values():
            if c.restart_at is not None:
                if now >= c.restart_at:
                    self._restart(c)
                continue
            code = c.proc.poll()
            if code is None:
                continue
            if c.may_exit and code == 0:
                finished.append(c.name)
            else:
                self._died(c, code, now)
        return finished

    def _died(self, c: Child, code: int, now: float, why: str = "") -> None:
        if self.policy is None:
            raise ChildDied(c.name, code, c.tail(), why)
        while c.restarts and now - c.restarts[0] > self.policy.window_s:
            c.restarts.popleft()
        if len(c.restarts) >= self.policy.max_restarts:
            raise CrashLoop(
                c.name, code, c.tail(40), f"{why}; {len(c.restarts)} restarts within {self.policy.window_s:.0f} s"
            )
        delay = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** len(c.restarts))
        c.restarts.append(now)
        c.last_code, c.restart_at = code, now + delay
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
        self.restarts_total += 1
        log.info("restarted %s", kv(name=c.name, pid=c.proc.pid, restarts=len(c.restarts)))

    def declare_hung(self, name: str, why: str) -> None:
        """Kill a child that stopped making progress (SIGKILL) and restart it per the policy."""
        c = self.children[name]
        if c.proc.poll() is None:
            os.kill(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
        self._died(c, c.proc.returncode, time.monotonic(), f" (hung: {why})")

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
                log.warning("child ignored SIGTERM; killing %s", kv(name=name, pid=c.proc.pid))
                os.kill(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        return c.proc.returncode

    def kill9(self, name: str) -> None:
        """SIGKILL one child (fault injection in tests and benchmarks) and forget it."""
        c = self.children.pop(name)
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait()

    def stop_all(self, timeout: float = 40.0) -> dict[str, int | None]:
        """SIGTERM everyone first (so they shut down in parallel), then wait, then SIGKILL."""
        for c in self.children.values():
            if c.proc.poll() is None:
                try:
                    os.kill(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        codes = {}
        for name in list(self.children):
            c = self.children[name]
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("child did not stop in time; killing %s", kv(name=name, pid=c.proc.pid))
                os.kill(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
            codes[name] = c.proc.returncode
        self.children.clear()
        return codes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()
