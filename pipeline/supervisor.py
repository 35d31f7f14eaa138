"""Supervise child processes of one run (the demo, benchmarks): start each with its own log file,
notice at once when one dies unexpectedly, and stop them all by PID.

It is not a cluster manager: every child runs on this machine and is killed with the run.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import RlstreamError
from pipeline.log import kv

log = logging.getLogger(__name__)


class ChildDied(RlstreamError):
    """A supervised process exited while the run still needed it."""

    def __init__(self, name: str, code: int, log_tail: str):
        self.name, self.code, self.log_tail = name, code, log_tail
        super().__init__(f"{name} exited with code {code}; last lines of its log:\n{log_tail}")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    may_exit: bool = False  # True for processes that finish on their own (feed, trainer)
    started_at: float = field(default_factory=time.monotonic)

    def tail(self, lines: int = 20) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""


class Supervisor:
    def __init__(self, log_dir: Path, env: dict[str, str] | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env if env is not None else os.environ)
        self.children: dict[str, Child] = {}

    def start(self, name: str, args: list[str], may_exit: bool = False, env: dict | None = None) -> Child:
        """Start ``python -m pipeline.cli <args>`` (or a full argv if it starts with '/')."""
        argv = args if args and os.path.isabs(args[0]) else [sys.executable, "-m", "pipeline.cli", *args]
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )
        child = Child(name, proc, log_path, may_exit)
        self.children[name] = child
        log.info("started %s", kv(name=name, pid=proc.pid, log=log_path))
        return child

    def check(self) -> list[str]:
        """Raise ChildDied if a child that must keep running has exited; return names that
        finished normally (exit 0, ``may_exit``)."""
        finished = []
        for c in self.children.values():
            code = c.proc.poll()
            if code is None:
                continue
            if c.may_exit and code == 0:
                finished.append(c.name)
            else:
                raise ChildDied(c.name, code, c.tail())
        return finished

    def alive(self, name: str) -> bool:
        c = self.children.get(name)
        return c is not None and c.proc.poll() is None

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
        """SIGKILL one child (fault-injection in tests and benchmarks) and forget it."""
        c = self.children.pop(name)
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait()

    def stop_all(self, timeout: float = 20.0) -> dict[str, int | None]:
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
                os.kill(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
            codes[name] = c.proc.returncode
        self.children.clear()
        return codes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()
