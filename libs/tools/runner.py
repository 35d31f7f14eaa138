"""Sandboxed tool calls: a ``module:function`` tool runs in a tool-runner process, never in the
rollout worker's own process.

A runner (``libs.tools._tool_runner``) is a small persistent Python process started through the
sandbox launcher (``libs.rewards._sandbox_launch``, the one sandboxed code runs under): its own
network namespace unless the network is allowed (``network``), an address-space limit
(RLIMIT_AS, ``memory_mb``), no core dumps, its own process group, and a parent-death signal. It
imports each tool once and serves one call at a time. Each call has a wall-clock deadline:

* a call that runs past it is stopped: its runner's process group is SIGKILLed (``timeout``);
* a call that allocates past the memory limit gets a MemoryError in the runner, which is then
  replaced (``memory``);
* a runner that dies during a call (the tool called ``os._exit``, a segfault) is ``crash``.

Runners are kept per process and option set (``RunnerPool``): a call takes an idle one or starts
one, so calls on several environment threads run in parallel, and a stopped runner is replaced
by the next call; the others and the worker are not affected. A runner imports a tool's module before its
first call of that tool, under its own deadline (``LOAD_TIMEOUT_S``). The deadline is the CPU bound too: no RLIMIT_CPU is set, since a
runner lives for many calls.

What this is not: the ``bwrap`` sandbox (the runner sees the filesystem as the worker does, so it
can import the tool's module from wherever the worker can) nor a parser or environment.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from libs.tools.base import ToolResult

log = logging.getLogger(__name__)
RUNNER = str(Path(__file__).with_name("_tool_runner.py"))
ROOT = str(Path(__file__).resolve().parents[2])
"""The directory rlstream's packages are in: the runner imports ``pipeline.plugins`` from there."""
START_TIMEOUT_S = 30.0
"""Longest the launcher may take to set a runner up."""
LOAD_TIMEOUT_S = 120.0
"""Longest a runner may take to import a tool's module (before its first call)."""


@dataclass(frozen=True)
class RunnerLimits:
    memory_mb: int = 1024
    """Address-space limit of a runner (RLIMIT_AS)."""
    network: bool = False
    """False: the runner has its own network namespace (no interfaces but a down loopback)."""
    dirs: tuple[str, ...] = ()
    """Where ``module:function`` modules are looked up first (``pipeline.plugins.load_object``):
    ``rollout.env.import_dirs`` and the directories the worker found the tools' modules in
    (``module_root``), so a runner imports what the worker imported."""


class RunnerDied(RuntimeError):
    """The runner could not be started, or ended without replying."""


class Runner:
    """One tool-runner process."""

    def __init__(self, limits: RunnerLimits):
        from libs.rewards.sandbox import LAUNCHER

        self.limits = limits
        status_r, status_w = os.pipe()
        rlimits = {"RLIMIT_CORE": (0, 0)}
        if limits.memory_mb:
            rlimits["RLIMIT_AS"] = (limits.memory_mb << 20, limits.memory_mb << 20)
        spec = {
            "status_fd": status_w,
            "mode": "namespaces",
            "deny_network": not limits.network,
            "require_isolation": False,  # checked below: only the network namespace is required
            "rlimits": rlimits,
            "cgroup": None,
            "uid": None,
            "ppid": os.getpid(),
            "argv": [sys.executable, RUNNER, json.dumps({"dirs": list(limits.dirs)})],
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", LAUNCHER, "run", json.dumps(spec)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                pass_fds=(status_w,),
            )
        finally:
            os.close(status_w)
        try:
            raw = _read_all(status_r, START_TIMEOUT_S)
        finally:
            os.close(status_r)
        status = json.loads(raw) if raw else {"error": "the launcher ended before it set the runner up"}
        if "error" not in status and not limits.network and status.get("network") == "shared":
            status["error"] = "cannot create a network namespace here"
        if "error" in status:
            self.kill()
            hint = "; set tool_network = true to run tools with the network" if not limits.network else ""
            raise RunnerDied(f"the tool runner could not start: {status['error']}{hint}")
        self.network = status.get("network")
        self._buf = b""
        self.loaded: set[str] = set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, ref: str, arguments: dict, timeout_s: float, max_chars: int = 0) -> dict:
        """The runner's reply to one call, ``{"status": "timeout"}`` past ``timeout_s`` (the runner
        is killed then); RunnerDied if it ended without replying. The tool's module is imported
        first, under ``LOAD_TIMEOUT_S``, so the import does not count against the call."""
        if ref not in self.loaded:
            reply = self._ask({"tool": ref}, LOAD_TIMEOUT_S)
            if reply.get("status") != "ok":
                return reply
            self.loaded.add(ref)
        return self._ask({"tool": ref, "arguments": arguments, "max_chars": max_chars}, timeout_s)

    def _ask(self, request: dict, timeout_s: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise RunnerDied(f"the tool runner had ended ({exc})") from exc
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                return {"status": "timeout"}
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.kill()
                raise RunnerDied(f"the tool runner ended (exit code {self.proc.returncode})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # cannot happen for a SIGKILLed child; say so if it does
            log.error("tool runner pid %d did not end after SIGKILL", self.proc.pid)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def module_root(ref: str) -> str | None:
    """The directory the (imported) module of ``module:function`` ``ref`` was found in: where its
    top-level package or module is; None for a module without a file."""
    name = ref.partition(":")[0]
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    return str(path.parents[name.count(".") + (path.name == "__init__.py")])


def _read_all(fd: int, timeout_s: float) -> str:
    out, deadline = b"", time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return out.decode()
        chunk = os.read(fd, 4096)
        if not chunk:
            return out.decode()
        out += chunk


class RunnerPool:
    """Idle runners of one option set: a call takes one (or starts one) and gives it back."""

    def __init__(self, limits: RunnerLimits):
        self.limits = limits
        self._idle: list[Runner] = []
        self._lock = threading.Lock()
        self.started = 0

    def call(self, name: str, ref: str, arguments: dict, timeout_s: float, max_chars: int = 0) -> ToolResult:
        """Run one call of tool ``name`` (``ref``: its module:function) in a runner; never raises."""
        with self._lock:
            runner = None
            while self._idle and runner is None:
                r = self._idle.pop()
                runner = r if r.alive() else r.kill()
        try:
            if runner is None:
                runner = Runner(self.limits)
                with self._lock:
                    self.started += 1
            reply = runner.call(ref, arguments, timeout_s, max_chars)
        except RunnerDied as exc:
            if runner is not None:
                runner.kill()
            return ToolResult(f"error: tool {name} was stopped: {exc}", "crash")
        status = reply.get("status")
        if status == "timeout":
            took = timeout_s if ref in runner.loaded else LOAD_TIMEOUT_S
            what = "timed out" if ref in runner.loaded else "its module's import timed out"
            return ToolResult(f"error: tool {name} was stopped: {what} after {took:g} s", "timeout")
        if status == "memory":
            runner.kill()
            return ToolResult(f"error: tool {name} was stopped: exceeded {self.limits.memory_mb} MB", "memory")
        with self._lock:
            self._idle.append(runner)
        if status == "error":
            return ToolResult(f"error: {reply.get('content', '')}", "error")
        return ToolResult(str(reply.get("content", "")))  # cut by the runner

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for r in idle:
            r.kill()


_POOLS: dict[RunnerLimits, RunnerPool] = {}
_POOLS_LOCK = threading.Lock()


def pool(limits: RunnerLimits) -> RunnerPool:
    """The process's runner pool for ``limits``."""
    with _POOLS_LOCK:
        p = _POOLS.get(limits)
        if p is None:
            p = _POOLS[limits] = RunnerPool(limits)
        return p


@atexit.register
def close_all() -> None:
    """Stop every idle runner (a runner also ends by itself when this process does)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for p in pools:
        p.close()
