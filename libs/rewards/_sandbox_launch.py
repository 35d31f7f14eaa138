"""Sandbox launcher: applies isolation and limits to itself, then execs the untrusted program.

Run by ``libs.rewards.sandbox`` as ``python -I -S _sandbox_launch.py run <spec-json>`` with the
program's stdin/stdout/stderr already redirected, in a new session (its own process group), and a
status pipe on the fd named in the spec. It imports nothing from rlstream (it runs as a script).

Steps, in order: a new network namespace (as root ``unshare(CLONE_NEWNET)``; otherwise a new user
namespace with one; skipped in ``bwrap`` mode, where bubblewrap makes its own), joining the run's
cgroup v2 (when the spec names one), resource limits (CPU, address space, processes, file size,
open files, core dumps), dropping to an unprivileged uid (as root), a parent-death signal, then
``execv`` of the spec's argv: the program itself, or in ``bwrap`` mode bubblewrap wrapping it (the
seccomp and json-status fds in its argv are inherited).

``python -I -S _sandbox_launch.py sweep <uid>`` instead kills every process of ``uid`` (as that
uid, ``kill(-1, SIGKILL)``), which also reaches children that left the process group.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
SETUP_FAILED = 121


def _unshare(libc, flags: int) -> bool:
    return libc.unshare(flags) == 0


def _run(spec: dict) -> None:
    status_fd = spec["status_fd"]
    status = {"network": "shared", "uid": os.getuid()}

    def fail(reason: str) -> None:
        status["error"] = reason
        os.write(status_fd, json.dumps(status).encode())
        os._exit(SETUP_FAILED)

    libc = ctypes.CDLL(None, use_errno=True)
    if spec.get("mode") == "bwrap":
        status["network"] = "netns" if spec["deny_network"] else "shared"  # bwrap --unshare-net
    elif spec["deny_network"]:
        if _unshare(libc, CLONE_NEWNET):
            status["network"] = "netns"
        elif spec["uid"] is None and _unshare(libc, CLONE_NEWUSER | CLONE_NEWNET):
            status["network"] = "userns+netns"
        elif spec["require_isolation"]:
            fail(f"cannot create a network namespace: {os.strerror(ctypes.get_errno())}")
    if spec.get("cgroup"):
        try:
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            status["cgroup"] = spec["cgroup"]
        except OSError as exc:
            if spec["require_isolation"]:
                fail(f"cannot join cgroup {spec['cgroup']}: {exc}")
    try:
        for name, (soft, hard) in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError) as exc:
        fail(f"setrlimit: {exc}")
    uid = spec["uid"]
    if uid is not None:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError as exc:
            if spec["require_isolation"]:
                fail(f"cannot drop to uid {uid}: {exc}")
        status["uid"] = os.getuid()
    elif spec["require_isolation"] and os.getuid() == 0:
        fail("running as root without a uid drop")
    # After the uid change (which clears it): die with the scoring process.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != spec["ppid"]:
        os._exit(SETUP_FAILED)
    os.write(status_fd, json.dumps(status).encode())
    os.close(status_fd)
    try:
        os.execv(spec["argv"][0], spec["argv"])
    except OSError as exc:
        sys.stderr.write(f"sandbox: cannot exec {spec['argv'][0]}: {exc}\n")
        os._exit(SETUP_FAILED + 1)


def _sweep(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        os.kill(-1, signal.SIGKILL)  # every process this uid may signal, except this one
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _run(json.loads(sys.argv[2]))
    elif sys.argv[1] == "sweep":
        _sweep(int(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} run <spec> | sweep <uid>")
