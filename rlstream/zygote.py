"""The fork server's own process (``python -m rlstream.zygote <modules>``, started by
``rlstream.forkserver.ForkServer``): import the modules, say ``ready`` (refusing when the imports
left a thread running or CUDA initialised), then fork one role per request and report each one's
exit code. Nothing imports this module: it runs as ``__main__``, and only the forked child runs the
CLI.

CUDA: a child forked from a process that has initialised CUDA cannot use the GPU (the driver's state
does not survive a fork). The server never initialises it itself (the modules it preloads make no
``torch.cuda`` call at import time), and it checks before saying ``ready`` and before each fork:
if CUDA is initialised it refuses, and the supervisor starts plain processes. The check asks
``torch.cuda.is_initialized()`` only where torch is already imported (it never imports torch for
it). ``RLSTREAM_FORKSERVER_ASSUME_CUDA=1`` in the server's environment makes the check find CUDA
initialised (to see the fallback on a machine without a GPU)."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def cuda_refusal() -> str | None:
    """Why forking is unsafe for a role that may use the GPU (CUDA is initialised here); None if it
    is not (or torch was never imported: then nothing here initialised CUDA)."""
    from rlstream.forkserver import ASSUME_CUDA

    if os.environ.get(ASSUME_CUDA) == "1":
        return f"CUDA is initialised in the fork server ({ASSUME_CUDA}=1): a forked role could not use the GPU"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA is initialised in the fork server: a forked role could not use the GPU"
    return None


def _say(msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def _import(modules: list[str], failed: list[str]) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an optional module (an extra not installed): the role imports it itself
            failed.append(name)
            print(f"[forkserver] cannot preload {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _ready(stage: str, t0: float, failed: list[str]) -> bool:
    """Say that ``stage`` is imported; False (and say why) when forking is no longer safe."""
    threads = _threads()
    why = f"{threads} threads after the imports: forking is unsafe" if threads != 1 else cuda_refusal()
    ok = why is None
    if ok:
        import gc

        gc.freeze()  # the imported objects: never scanned by a child's collections, so their pages
        # stay shared instead of being copied when the collector touches them
    _say({"ready": stage, "ok": ok, "import_s": round(time.monotonic() - t0, 2), "failed": failed,
          **({} if ok else {"why": why})})  # fmt: skip
    return ok


class _Requests:
    """The server's stdin (one JSON request a line) and its children's exits."""

    def __init__(self):
        self.buf = b""
        self.wake_r, wake_w = os.pipe()
        self.wake_w = wake_w
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.closed = False
        self.forked = 0

    def serve(self, timeout: float | None) -> dict | None:
        """Wait up to ``timeout`` (None: until something happens) for requests, report exited
        children, fork one child per request; returns the request in the child, None in the server
        (``closed`` once the supervisor closed our stdin)."""
        try:
            ready = select.select([0, self.wake_r], [], [], timeout)[0]
        except InterruptedError:
            ready = []
        if self.wake_r in ready:
            os.read(self.wake_r, 4096)
        while True:  # reap every child that has exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if 0 not in ready:
            return None
        data = os.read(0, 65536)
        if not data:  # the supervisor closed our stdin: done (children still running get SIGTERM)
            self.closed = True
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            req = json.loads(line)
            req["server_pid"] = os.getpid()  # (after a fork, getppid() is 1 once the server died)
            if (why := cuda_refusal()) is not None:  # no fork; the supervisor starts a plain process
                _say({"error": why, "refused": "cuda"})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:
                _say({"error": f"fork: {exc}"})
                continue
            self.forked += 1
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(self.wake_r)
                os.close(self.wake_w)
                return req
            _say({"pid": pid})
        return None

    def drain(self) -> dict | None:
        """Between two imports: serve the requests waiting now, and each one that follows a fork
        within ``NEXT_REQUEST_S`` (the supervisor sends its next request as soon as it has the
        answer), so a job's first-stage roles start together instead of one per import."""
        timeout = 0.0
        while not self.closed:
            before = self.forked
            if (req := self.serve(timeout)) is not None:
                return req
            if self.forked == before:
                break
            timeout = NEXT_REQUEST_S
        return None


NEXT_REQUEST_S = 0.1


def _serve(argv: list[str]) -> dict | None:
    """Import the modules, then fork on request; returns only in a forked child (its request).

    ``argv``: ``first... [--then rest...]``. With ``--then``, the server says ``ready: "first"``
    once the first modules are in and serves requests between each of the others' imports (a role
    that needs only the first starts seconds sooner: the supervisor sends its request only then),
    then ``ready: "all"``."""
    from pipeline.worker import die_with_parent
    from rlstream.forkserver import THEN

    die_with_parent()  # SIGTERM when the supervisor dies; the default action ends us, and then our
    # children get theirs
    first, rest = (argv[: argv.index(THEN)], argv[argv.index(THEN) + 1 :]) if THEN in argv else (argv, [])
    t0 = time.monotonic()
    failed: list[str] = []
    _import(first, failed)
    requests = None
    if rest:
        if not _ready("first", t0, failed):
            return None
        requests = _Requests()
        for name in rest:
            if (req := requests.drain()) is not None or requests.closed:
                return req
            _import([name], failed)
    if not _ready("all", t0, failed):
        return None
    requests = requests or _Requests()
    while not requests.closed:
        if (req := requests.serve(None)) is not None:
            return req
    return None


def _become(req: dict) -> None:
    """In the forked child: the process ``python -m rlstream <args>`` would have been."""
    os.setsid()
    log_fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null)
    env = dict(req["env"])
    env["RLSTREAM_PARENT_PID"] = str(req["server_pid"])  # the parent that must not vanish
    os.environ.clear()
    os.environ.update(env)
    import rlstream.__main__ as entry

    sys.argv = [entry.__file__, *req["args"]]  # as ``python -m rlstream`` sets it (click's usage line)


THREAD_JOIN_S = 30.0
"""How long a forked role's exit waits for its threads that are not daemons."""


def exit_code(exc: SystemExit) -> int:
    """The status ``raise SystemExit(x)`` gives a Python process (a message is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _exit_without_module_teardown(code: int) -> None:
    """End the forked role as the interpreter's exit would (its non-daemon threads joined, ``atexit``
    handlers run: logging's flush among them, output flushed), but without tearing down every
    module: the role inherited torch and transformers from the server, and freeing their objects one
    by one writes to pages it shares with the server, which copies them first (measured on
    examples/next-digit.toml: the trainer's exit 1.9-2.2 s -> 0.2-0.3 s, the other roles stopped
    6.1-6.5 s -> 0.4-0.8 s after the last step). Everything a role must do before it ends (producer flushes,
    transactions, checkpoints) it does in its own ``finish``/``close``, which have run by now."""
    import atexit
    import threading

    # the interpreter's exit first waits for the threads that are not daemons, without a bound; here
    # the wait is bounded, so a role whose thread hangs still ends (loudly) and the supervisor sees it
    deadline = time.monotonic() + THREAD_JOIN_S
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                print(f"rlstream: thread {t.name!r} still running {THREAD_JOIN_S:g} s after the role ended: "
                      "exiting without it", file=sys.stderr)  # fmt: skip
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)  # as the OS reads a larger or negative status


def main(argv: list[str]) -> None:
    req = _serve(argv)
    if req is None:
        return
    _become(req)
    from rlstream.__main__ import main as rlstream_main

    try:
        rlstream_main()
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    except KeyboardInterrupt:
        # as Python does: the traceback, then death by SIGINT (the parent reads -2)
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the traceback, as an uncaught exception prints it
        code = 1
    _exit_without_module_teardown(code)


if __name__ == "__main__":
    main(sys.argv[1:])
