"""A fork server for the supervisor: one process imports torch, transformers and the role modules
once, then forks each role from that state, so a job's five or six roles pay for one import (4-9 s
of CPU each on a small machine) instead of one each.

``ForkServer`` (the supervisor's side) starts ``python -m rlstream.zygote <modules>`` (the server)
with pipes; the server imports the modules, checks that it is still single-threaded (forking a process
that runs native threads is unsafe: it refuses, and the supervisor starts plain processes), says
``ready`` and then serves requests (in two stages: the modules before ``--then`` first, then the
roles that need only those fork while it imports the rest), one JSON line each on its stdin (``args``, ``env``, ``log``),
answering each with the forked child's PID and reporting every child's exit code as it happens
(negative: killed by that signal, as ``subprocess.Popen.returncode``). ``ForkedProc`` is the
supervisor's handle on such a child, with ``Popen``'s ``pid``, ``poll``, ``wait`` and
``returncode``.

The child is a role as ``python -m rlstream <args>`` would start it: its own session, its log file
as stdout and stderr, stdin from /dev/null, the environment it was asked for, and the server as its
supervising parent (``RLSTREAM_PARENT_PID``: it gets SIGTERM when the server dies, and the server
gets SIGTERM when the supervisor dies, so no child outlives the run). It then runs the CLI and
exits through the interpreter's normal shutdown.

Nothing here is needed for correctness: any failure of the server (it cannot import, it is not
single-threaded, it has initialised CUDA, it died, it did not answer in time) is logged in one
warning line and the supervisor falls back to plain processes. CUDA: a child forked from a process
that initialised CUDA cannot use the GPU, so the server refuses to say ready, or to fork, once CUDA
is initialised in it (``rlstream.zygote.cuda_refusal``); from then on every role is a plain
process. ``job.fork_server = false`` turns it off.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

THEN = "--then"
"""Between the fork server's two stages of modules (``rlstream.zygote`` reads it)."""

FIRST_MODULES = ["rlstream.cli", "rlstream.config", "confluent_kafka", "producers.feed", "consumers.reward.worker"]
"""What the roles in ``FIRST_COMMANDS`` import: no torch, no transformers (~0.4 s)."""
FIRST_COMMANDS = ("feed", "reward")
"""Roles forked as soon as ``FIRST_MODULES`` are in, while the server imports the rest: a job's
reward workers then join their consumer group (whose first assignment waits for more members, 2 s
on the local broker) seconds before the first rollout comes, instead of after the rollout workers
start. A role of these that imports torch itself (a user's reward model) pays that import alone."""
ROLE_MODULES = [
    *FIRST_MODULES,
    THEN,
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "producers.rollout",
    "consumers.trainer.worker",
    "consumers.eval.worker",
]
"""What every job's roles import, in two stages (the model's own modeling module is added by the
launcher)."""

ASSUME_CUDA = "RLSTREAM_FORKSERVER_ASSUME_CUDA"
"""Set to ``1`` (in the environment of the command that starts the job), the fork server acts as
if CUDA were initialised in it: it refuses to fork, and every role is a plain process."""

READY_TIMEOUT_S = 300.0  # the imports, on a loaded machine
ANSWER_TIMEOUT_S = 30.0  # a fork request's answer (the server only forks and writes one line)


class ForkServer:
    """The supervisor's side: start the server (it imports in the background while the caller goes
    on), fork roles from it, read their exit codes. ``usable`` is False once anything went wrong;
    callers then start plain processes."""

    def __init__(self, env: dict[str, str], modules: list[str], log_path: Path | None = None):
        self.log_path, self.env = log_path, env
        """Where the server's own output (a module it could not import, a crash) is saved when it
        stops; set it any time before (a launcher starts the server before its run dir may be
        written to). Until then the output waits in an unlinked temporary file."""
        self.codes: dict[int, int] = {}  # pid -> exit code, as the server reports them
        self.children: set[int] = set()
        self._buf = b""
        self._replies: list[dict] = []
        self.ready: dict | None = None
        """The server's answer once every module is imported (``ok``: it can fork)."""
        self.first: dict | None = None
        """Its answer once the modules before ``THEN`` are (the roles in ``FIRST_COMMANDS`` fork then)."""
        self.usable = True
        self.refused: str | None = None
        """Why the server refused to fork (CUDA initialised in it): every later role is a plain
        process, while the roles forked before keep their parent and their exit codes."""
        self.t0 = time.monotonic()
        fd, tmp = tempfile.mkstemp(prefix="rlstream-forkserver-", suffix=".log")
        os.unlink(tmp)  # nothing to clean up, whatever happens to this process
        self._out = fd
        if ASSUME_CUDA in os.environ and ASSUME_CUDA not in env:  # (roles' environments drop RLSTREAM_*)
            env = {**env, ASSUME_CUDA: os.environ[ASSUME_CUDA]}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlstream.zygote", *modules],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=fd,
            env=env,
            start_new_session=True,
        )
        os.set_blocking(self.proc.stdout.fileno(), False)

    # -- reading the server ------------------------------------------------------------------
    def pump(self, timeout: float = 0.0) -> bool:
        """Read what the server has written (waiting up to ``timeout`` for something); False when
        the server has gone (its pipe closed)."""
        if self.proc.stdout.closed:
            return False
        fd = self.proc.stdout.fileno()
        if select.select([fd], [], [], max(0.0, timeout))[0]:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                data = None
            if data == b"":
                self._gone("the fork server exited")
                return False
            self._buf += data or b""
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if "exit" in msg:
                    self.codes[msg["exit"]] = msg["code"]
                    self.children.discard(msg["exit"])
                elif msg.get("ready") == "first" and msg.get("ok"):
                    self.first = msg
                elif "ready" in msg:
                    self.ready = msg
                else:
                    self._replies.append(msg)
        return self.usable

    def save_log(self) -> None:
        """Write the server's output so far to ``log_path`` (if set)."""
        if self.log_path is None or self._out is None:
            return
        size = os.fstat(self._out).st_size
        Path(self.log_path).write_bytes(os.pread(self._out, size, 0))

    def _gone(self, why: str, quiet: bool = False) -> None:
        if self.usable:
            self.usable = False
            code = self.proc.poll()
            self.save_log()
            if not quiet:
                log.warning(
                    "fork server unusable; starting plain processes %s", _kv(why=why, code=code, log=self.log_path)
                )
        # its children got SIGTERM from the kernel when it died (PR_SET_PDEATHSIG); once gone they
        # count as stopped by that signal (their real codes went with the server)
        for pid in list(self.children):
            if not _alive(pid):
                self.codes.setdefault(pid, -signal.SIGTERM)
                self.children.discard(pid)

    def _wait_for(self, what, deadline: float) -> bool:
        while not what():
            left = deadline - time.monotonic()
            if left <= 0 or not self.pump(min(left, 1.0)):
                return bool(what())
        return True

    def wait_ready(self, first: bool = False) -> bool:
        """Block until the server has imported everything (``first``: the first stage) or failed;
        whether it can fork."""
        if self.usable and self.ready is None and not (first and self.first is not None):
            if not self._wait_for(
                lambda: self.ready is not None or (first and self.first is not None), self.t0 + READY_TIMEOUT_S
            ):
                self._gone(f"not ready after {READY_TIMEOUT_S:.0f} s")
                self.close()
            elif self.ready is not None and not self.ready.get("ok"):
                self._gone(self.ready.get("why", "refused"))
                self.close()
            elif self.ready is not None:
                log.info("fork server ready %s", _kv(import_s=self.ready.get("import_s"), pid=self.proc.pid))
        return self.usable

    # -- forking -----------------------------------------------------------------------------
    def spawn(self, args: list[str], env: dict[str, str], log_path: Path) -> ForkedProc | None:
        """Fork ``rlstream <args>`` with ``env``, its output appended to ``log_path``; None when the
        server cannot, or when ``env`` differs from the server's own (threads, devices, caches are
        read at import time): the caller starts a plain process."""
        if _outer(env) != _outer(self.env):
            theirs, ours = _outer(env), _outer(self.env)
            keys = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
            log.info("another environment than the fork server's: a plain process %s", _kv(keys=",".join(keys)))
            return None
        early = bool(args) and args[0] in FIRST_COMMANDS
        if self.refused is not None or not self.wait_ready(first=early):
            return None
        # the server answers a request between two imports until it has them all
        answer_by = time.monotonic() + ANSWER_TIMEOUT_S
        if self.ready is None:
            answer_by = max(answer_by, self.t0 + READY_TIMEOUT_S)
        log_path.touch()  # there at once, as a plain process's (the child appends to it)
        request = json.dumps({"args": args, "env": env, "log": str(log_path)}) + "\n"
        try:
            self.proc.stdin.write(request.encode())
            self.proc.stdin.flush()
        except OSError as exc:
            self._gone(f"cannot write to it: {exc}")
            return None
        if not self._wait_for(lambda: self._replies, answer_by):
            self._gone(f"no answer to a fork request in {ANSWER_TIMEOUT_S:.0f} s")
            self.close()
            return None
        reply = self._replies.pop(0)
        if reply.get("refused"):
            self.refused = reply.get("error") or reply["refused"]
            log.warning("fork server refuses to fork; starting plain processes %s", _kv(why=self.refused))
            return None
        if "pid" not in reply:
            log.warning("fork server could not fork %s", _kv(error=reply.get("error"), args=" ".join(args)))
            return None
        self.children.add(reply["pid"])
        return ForkedProc(self, reply["pid"], args)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the server: EOF on its stdin, once it serves (SIGKILL if it does not exit within
        ``timeout``); SIGKILL at once while it still imports. Idempotent."""
        if self._out is None:
            return
        self.usable = False
        if self.proc.poll() is None:
            if self.ready is None:
                self.proc.kill()
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._gone("closed", quiet=True)
        self.save_log()
        os.close(self._out)
        self._out = None


class ForkedProc:
    """A role forked by the server: the part of ``subprocess.Popen`` the supervisor uses."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump()
            if self.pid not in self.server.codes and not self.server.usable:
                self.server._gone("", quiet=True)  # children of a dead server: settled once they are gone
            self.returncode = self.server.codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.5 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(["rlstream", *self.args], timeout)
            if self.server.usable:
                self.server.pump(min(left, 0.5))
            else:
                time.sleep(min(left, 0.05))
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _outer(env: dict[str, str]) -> dict[str, str]:
    """The environment without rlstream's own per-process variables."""
    return {k: v for k, v in env.items() if not k.startswith("RLSTREAM_")}


def _alive(pid: int) -> bool:
    from pipeline.ports import pid_alive

    return pid_alive(pid)


def _kv(**fields) -> str:
    from pipeline.log import kv

    return kv(**fields)
