"""Run an untrusted Python program in a sandboxed subprocess, with limits, and report what happened.

Limits per run: wall time (the whole process group, and as root every process of the run's uid, is
SIGKILLed when it expires), RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NPROC (fork bombs),
RLIMIT_FSIZE (stdout/stderr go to files, so output is capped by the kernel), RLIMIT_NOFILE, no
core dumps, a fresh temporary working directory that is always removed, and no network where the
OS allows it (a new network namespace). As root the program also runs as an unprivileged uid
(``uid_base + pid of the scoring process``, unique among live scorers), which is what makes
RLIMIT_NPROC count only its own processes and lets a sweep kill children that escaped the
process group.

Not a security boundary against a determined attacker (no seccomp, the filesystem stays readable
where it is world-readable, no cgroups); it keeps buggy or greedy generated code from harming the
worker. Without root: the network namespace is tried through a user namespace, RLIMIT_NPROC counts
all the user's processes (so it is set to their current count plus the limit), and there is no uid
sweep. ``capabilities()`` says which protections are in effect.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path

from pipeline.log import kv

log = logging.getLogger(__name__)
LAUNCHER = str(Path(__file__).with_name("_sandbox_launch.py"))
SETUP_FAILED = 121
STATUSES = ("ok", "runtime_error", "timeout", "cpu_limit", "output_limit", "setup_error")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (see ``consumers.reward.config.SandboxConfig`` for their meaning)."""

    wall_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 1 << 20
    max_open_files: int = 64
    network: str = "deny"
    require_isolation: bool = False
    uid_base: int = 200_000
    python: str | None = None
    python_flags: tuple[str, ...] = ("-I",)

    @classmethod
    def from_config(cls, cfg=None, **overrides) -> SandboxLimits:
        """From a SandboxConfig (or defaults), with keyword overrides (unknown keys: TypeError)."""
        base = cls() if cfg is None else cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})
        known = {f.name for f in fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise TypeError(f"unknown sandbox limit(s) {bad}; known: {sorted(known)}")
        lim = replace(base, **overrides)
        return replace(lim, python_flags=tuple(lim.python_flags))


@dataclass
class RunResult:
    status: str
    """ok | runtime_error | timeout | cpu_limit | output_limit | setup_error"""
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _is_root() -> bool:
    return os.geteuid() == 0


def sandbox_uid(limits: SandboxLimits) -> int | None:
    """The uid programs run as: unique per scoring process when root, else None (no drop)."""
    return limits.uid_base + os.getpid() if _is_root() else None


def processes_of(uid: int) -> list[int]:
    """PIDs of live (not zombie) processes whose owner is ``uid`` (from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    with open(f"/proc/{name}/stat") as f:
                        state = f.read().rpartition(")")[2].split()[0]
                    if state not in ("Z", "X"):
                        out.append(int(name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


def _user_tasks(uid: int) -> int:
    """Threads of every process of ``uid`` (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in processes_of(uid):
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except FileNotFoundError:
            pass
    return n


def _world_accessible(path: str) -> bool:
    p = Path(os.path.realpath(path))
    for part in [p, *p.parents]:
        try:
            mode = os.stat(part).st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return True


@cache
def _interpreter(configured: str | None, dropping_uid: bool) -> str:
    """The interpreter programs run with. After a uid drop it must be reachable by anyone: the
    worker's own may live under a private home (pyenv in /root), so fall back to a system one."""
    if configured:
        return configured
    candidates = [sys.executable]
    if dropping_uid:
        candidates += [shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or ""]
    for c in candidates:
        if c and (not dropping_uid or _world_accessible(c)):
            return c
    return sys.executable  # the run will fail with setup_error and say why


def _kill_all(pgid: int, uid: int | None) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None and processes_of(uid):
        subprocess.run([sys.executable, "-I", "-S", LAUNCHER, "sweep", str(uid)], check=False, timeout=30)


def sweep(uid: int | None) -> None:
    """Kill every process left by sandbox runs of ``uid`` (used when a scoring process was killed)."""
    if uid is not None and _is_root() and processes_of(uid):
        subprocess.run([sys.executable, "-I", "-S", LAUNCHER, "sweep", str(uid)], check=False, timeout=30)


def _read_capped(path: Path, cap: int) -> tuple[str, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        data = f.read(cap)
    return data.decode("utf-8", errors="replace"), size


def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None) -> RunResult:
    """Run ``source`` as a Python program with ``stdin``; never raises for what the program does."""
    lim = limits or SandboxLimits()
    uid = sandbox_uid(lim)
    base = Path(tempfile.mkdtemp(prefix="rlstream-sbx-"))
    work, io_dir = base / "work", base / "io"
    work.mkdir()
    io_dir.mkdir(mode=0o700)
    t0 = time.monotonic()
    try:
        (work / "main.py").write_text(source)
        (io_dir / "stdin").write_text(stdin)
        if uid is not None:
            os.chmod(base, 0o711)
            for p in (work, work / "main.py"):
                os.chown(p, uid, uid)
            os.chmod(work, 0o700)
        nproc = lim.max_processes if uid is not None else _user_tasks(os.getuid()) + lim.max_processes
        rlimits = {
            "RLIMIT_CPU": (lim.cpu_s, lim.cpu_s + 1),
            "RLIMIT_AS": (lim.memory_mb << 20, lim.memory_mb << 20),
            "RLIMIT_NPROC": (nproc, nproc),
            "RLIMIT_FSIZE": (lim.max_output_bytes, lim.max_output_bytes),
            "RLIMIT_NOFILE": (lim.max_open_files, lim.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }
        python = _interpreter(lim.python, uid is not None)
        status_r, status_w = os.pipe()
        spec = {
            "status_fd": status_w,
            "deny_network": lim.network == "deny",
            "require_isolation": lim.require_isolation,
            "rlimits": rlimits,
            "uid": uid,
            "ppid": os.getpid(),
            "argv": [python, *lim.python_flags, str(work / "main.py")],
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "PYTHONHASHSEED": "0"}
        with (
            open(io_dir / "stdin", "rb") as fin,
            open(io_dir / "stdout", "wb") as fout,
            open(io_dir / "stderr", "wb") as ferr,
        ):
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", LAUNCHER, "run", json.dumps(spec)],
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    cwd=work,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(status_w,),
                )
            finally:
                os.close(status_w)
            timed_out = False
            try:
                proc.wait(timeout=lim.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_all(proc.pid, uid)
                proc.wait()
        with os.fdopen(status_r, "rb") as f:
            raw_status = f.read()
        wall = time.monotonic() - t0
        isolation = json.loads(raw_status) if raw_status else {}
        stdout, out_size = _read_capped(io_dir / "stdout", lim.max_output_bytes)
        stderr, err_size = _read_capped(io_dir / "stderr", lim.max_output_bytes)
        rc = proc.returncode
        exec_failed = rc == SETUP_FAILED + 1 and stderr.startswith("sandbox: cannot exec")
        if "error" in isolation or exec_failed or (not raw_status and not timed_out):
            status = "setup_error"
            stderr = isolation.get("error") or stderr or f"launcher exited {rc} before starting the program"
        elif timed_out:
            status = "timeout"
        elif max(out_size, err_size) >= lim.max_output_bytes or rc == -signal.SIGXFSZ:
            status = "output_limit"
        elif rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and not timed_out):
            status = "cpu_limit"
        elif rc != 0:
            status = "runtime_error"
        else:
            status = "ok"
        return RunResult(status, rc, stdout, stderr[-4000:], wall, isolation)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@cache
def capabilities() -> dict:
    """Which protections a run gets here: network isolation and the uid drop (probed once)."""
    res = run_python("print('ok')", limits=SandboxLimits(wall_s=20))
    caps = {
        "network": res.isolation.get("network", "unknown"),
        "uid_drop": bool(_is_root() and res.isolation.get("uid") not in (None, 0)),
        "probe": res.status,
    }
    log.info("sandbox capabilities %s", kv(**caps))
    return caps
