"""The code sandbox under bubblewrap + seccomp: escapes are contained, hostile programs score 0, and
the fallback without bubblewrap is loud (or, with require_isolation, refused).

bubblewrap comes from scripts/setup-infra-tools.sh (Debian's ``bubblewrap``); without it, or where
the kernel refuses it user namespaces, the bwrap tests skip and say why."""

from __future__ import annotations

import json
import logging
import os
import socket
import textwrap
import uuid

import pytest
from pydantic import ValidationError

from libs.rewards import cgroups, sandbox
from libs.rewards.base import RewardError, build
from libs.rewards.config import SandboxConfig
from libs.rewards.sandbox import SandboxLimits, processes_of, run_python, sandbox_uid

LIMITS = {"wall_s": 10.0, "cpu_s": 2, "memory_mb": 256, "max_processes": 8, "max_output_bytes": 64 * 1024}
BW = SandboxLimits.from_config(isolation="bwrap", **LIMITS)


@pytest.fixture(scope="module", autouse=True)
def bwrap_works():
    res = run_python("print('ok')", "", BW)
    if res.status != "ok":
        pytest.skip(f"bubblewrap sandbox unavailable here: {res.stderr.strip()[-300:]}")


def run(program: str, limits: SandboxLimits = BW, stdin: str = ""):
    return run_python(textwrap.dedent(program), stdin, limits)


def score(program: str, **kw) -> float:
    tests = {"tests": [{"input": "3\n", "output": "9\n"}]}
    traj = {"task": "code", "prompt_text": "square", "response_text": program, "reference": json.dumps(tests)}
    return build("code", {"isolation": "bwrap", **LIMITS, **kw})(traj).reward


def test_code_reward_defaults_to_bwrap():
    caps = sandbox.capabilities()  # what the `code` reward gets from SandboxConfig()
    assert caps["sandbox"] == "bwrap" and caps["seccomp"] and caps["fallback"] is None
    assert score("n = int(input())\nprint(n * n)\n") == 1.0
    res = run(
        """
        import json, os, socket
        print(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "top": os.listdir("/"),
                          "etc": os.listdir("/etc")}))
        """
    )
    assert res.status == "ok", res.stderr
    assert res.isolation["sandbox"] == "bwrap" and res.isolation["network"] == "netns"
    seen = json.loads(res.stdout)
    assert seen["pid"] == 1 and seen["host"] == "sandbox"  # own pid namespace (the program is its init), own uts
    assert not {"home", "root", "var", "srv", "opt", "mnt"} & set(seen["top"]), seen
    assert set(seen["etc"]) <= {"ld.so.cache", "ld.so.conf", "localtime"}, seen  # no passwd, shadow, ssl, ...


def test_network_connect_to_localhost_fails():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        prog = f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as exc:
                print("blocked", exc.errno)
            """
        filtered = run(prog)  # seccomp: no AF_INET socket at all
        unfiltered = run(prog, SandboxLimits.from_config(isolation="bwrap", seccomp=False, **LIMITS))  # empty netns
        srv.settimeout(0.5)
        with pytest.raises(TimeoutError):
            srv.accept()
    assert filtered.stdout.strip() == "blocked 97", filtered  # EAFNOSUPPORT
    assert unfiltered.stdout.startswith("blocked"), unfiltered  # no route to the host's loopback


def test_filesystem_is_read_only_except_the_work_dir(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    escape = f"/tmp/rlstream-escape-{uuid.uuid4().hex}"
    res = run(
        f"""
        import os
        for path in ("/etc/shadow", "/etc/passwd", {str(secret)!r}):
            try:
                print("read", path, len(open(path).read()))
            except OSError as exc:
                print("noread", path, exc.errno)
        for path in ({escape!r}, "/usr/escape", "/escape", {os.path.dirname(os.__file__) + "/escape"!r}):
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as exc:
                print("nowrite", path, exc.errno)
        open("inside.txt", "w").write("ok")
        print("cwd", os.getcwd(), open("inside.txt").read())
        """
    )
    assert res.status == "ok", res.stderr
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["noread"] * 3, lines
    assert [line.split()[0] for line in lines[3:7]] == ["nowrite"] * 4, lines
    assert lines[7].startswith("cwd ") and lines[7].endswith(" ok")
    assert not os.path.exists(escape) and not os.path.exists(lines[7].split()[1])  # work dir removed after


def test_seccomp_denies_dangerous_syscalls():
    prog = """
        import ctypes, errno, os, socket, threading
        libc = ctypes.CDLL(None, use_errno=True)
        def call(name, *args):
            ret = getattr(libc, name)(*args)
            return 0 if ret == 0 else ctypes.get_errno()
        print("ptrace", call("ptrace", 0, 0, 0, 0))                  # PTRACE_TRACEME
        print("unshare", call("unshare", 0x10000000))                # CLONE_NEWUSER
        print("mount", call("mount", b"none", b"/tmp", b"tmpfs", 0, None))
        print("io_uring", call("syscall", 425, 8, ctypes.c_void_p(0)))  # io_uring_setup (x86_64, arm64)
        for fam in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):
            try:
                socket.socket(fam, socket.SOCK_RAW if fam == socket.AF_PACKET else socket.SOCK_DGRAM).close()
                print("socket", fam, 0)
            except OSError as exc:
                print("socket", fam, exc.errno)
        a, b = socket.socketpair()                                   # AF_UNIX stays allowed
        t = threading.Thread(target=lambda: a.send(b"x")); t.start(); t.join()  # threads: clone3 -> clone
        print("unix", b.recv(1).decode())
        """
    res = run(prog)
    assert res.status == "ok", res.stderr
    got = dict(line.rsplit(" ", 1) for line in res.stdout.splitlines())
    eperm, noaf = str(1), str(97)
    assert got.pop("ptrace") == got.pop("unshare") == got.pop("mount") == got.pop("io_uring") == eperm, got
    assert got.pop("unix") == "x"
    assert set(got.values()) == {noaf}, got  # every non-AF_UNIX socket family
    without = run(prog, SandboxLimits.from_config(isolation="bwrap", seccomp=False, **LIMITS))
    assert without.status == "ok" and "ptrace 0" in without.stdout.splitlines()  # it is the filter that denies


def test_fork_bomb_is_contained_and_scores_zero():
    bomb = """
        import os, sys, time
        for level in range(7):            # 2**7 processes without a limit
            try:
                pid = os.fork()
            except OSError:
                break
            if pid:
                sys.stdout.write(f"{pid}\\n"); sys.stdout.flush()
        time.sleep(600)
        """
    lim = SandboxLimits.from_config(isolation="bwrap", **{**LIMITS, "wall_s": 5.0})
    res = run(bomb, lim)
    assert res.status == "timeout", res
    assert 1 <= len(res.stdout.split()) < lim.max_processes
    if sandbox_uid(lim) is not None:
        assert not processes_of(sandbox_uid(lim))  # the whole pid namespace went with it
    assert score(textwrap.dedent(bomb), wall_s=5.0) == 0.0


def test_memory_hog_and_infinite_loop_are_contained_and_score_zero():
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
    res = run(hog)
    assert res.status == "runtime_error" and "MemoryError" in res.stderr
    assert score(hog) == 0.0
    slow_ok = SandboxLimits.from_config(isolation="bwrap", **{**LIMITS, "cpu_s": 1, "wall_s": 60.0})  # loaded CPU
    spin = run("while True:\n    pass\n", slow_ok)
    assert spin.status == "cpu_limit" and spin.returncode < 0
    assert score("while True:\n    pass\n") == 0.0


def test_without_bwrap_the_fallback_is_loud_or_refused(caplog):
    missing = "/nonexistent/bwrap-" + uuid.uuid4().hex[:8]
    caplog.set_level(logging.WARNING, logger="libs.rewards.sandbox")
    res = run("print('ran')", SandboxLimits.from_config(bwrap=missing, **LIMITS))
    assert res.status == "ok" and res.stdout == "ran\n"
    assert res.isolation["sandbox"] == "namespaces" and missing in res.isolation["fallback"]
    assert any("SANDBOX FALLBACK" in r.getMessage() and missing in r.getMessage() for r in caplog.records)
    refused = run("print('ran')", SandboxLimits.from_config(bwrap=missing, require_isolation=True, **LIMITS))
    assert refused.status == "setup_error" and "bwrap" in refused.stderr and refused.stdout == ""
    with pytest.raises(RewardError, match="sandbox setup failed"):
        score("print(9)", bwrap=missing, require_isolation=True, isolation="auto")
    assert run("print(1)", SandboxLimits.from_config(bwrap=missing, isolation="bwrap")).status == "setup_error"


def test_sandbox_config_fields_are_validated():
    assert SandboxConfig().isolation == "auto" and SandboxConfig().seccomp
    assert SandboxConfig(isolation="bwrap", cgroup_parent="/sys/fs/cgroup/rl").cgroup_parent == "/sys/fs/cgroup/rl"
    for bad in ({"isolation": "chroot"}, {"cgroup_parent": "relative/dir"}, {"bwrap": ""}):
        with pytest.raises(ValidationError):
            SandboxConfig(**bad)


def test_cgroup_limits_when_delegated():
    parent = cgroups.cgroup_parent(None)
    if parent is None:
        pytest.skip("no writable cgroup v2 with memory+pids delegated to this process (limits off, logged)")
    res = run("print('ok')")
    assert res.status == "ok" and res.isolation["cgroup"]
    assert not [p for p in parent.iterdir() if p.name.startswith(f"rlstream-sbx-{os.getpid()}-")]
