"""Run an untrusted Python program in a sandboxed subprocess, with limits, and report what happened.

Limits per run: wall time (the whole process group, and as root every process of the run's uid, is
SIGKILLed when it expires), RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NPROC (fork bombs),
RLIMIT_FSIZE (stdout/stderr go to files, so output is capped by the kernel), RLIMIT_NOFILE, no
core dumps, and a fresh temporary working directory that is always removed. As root the program
also runs as an unprivileged uid (``uid_base + pid of the scoring process``, unique among live
scorers), which is what makes RLIMIT_NPROC count only its own processes and lets a sweep kill
children that escaped the process group.

Isolation (``isolation``):

* ``bwrap``: bubblewrap puts the program in new user, pid, network (no interfaces but loopback),
  ipc, uts and cgroup namespaces, with no capabilities, ``--die-with-parent``, and a filesystem
  made of read-only binds of /usr (and /bin, /lib...), the interpreter's prefixes and ld.so's
  cache, fresh /proc and /dev, and the private writable work directory; everything else,
  including /etc, /home and /tmp, is absent and the root is read-only. A seccomp filter
  (``libs.rewards.seccomp``) denies ptrace, mount and namespace calls, keyrings, bpf, io_uring,
  kexec, module loading and (with ``network = "deny"``) sockets other than AF_UNIX.
* ``namespaces``: the launcher's own setup only (rlimits, a network namespace where the OS allows
  it, the uid drop). Not a security boundary against a determined attacker: no seccomp, the
  filesystem stays readable where it is world-readable.
* ``auto``: bwrap when it works here (probed once per process), else a LOUD fallback to
  ``namespaces`` (one warning per process and ``isolation["fallback"]`` on every result); with
  ``require_isolation`` the run fails instead (setup_error).

Optional cgroup v2 limits (memory.max = memory_mb, pids.max, no swap) apply in either mode when a
writable cgroup with the memory and pids controllers is available (``cgroup_parent``); otherwise
one log line says they are off. ``SandboxLimits()`` built directly defaults to ``namespaces``
(the behaviour before bwrap); ``SandboxLimits.from_config`` (what the ``code`` reward uses)
defaults to ``SandboxConfig``'s ``auto``. ``capabilities()`` says which protections are in effect.
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

from libs.rewards import cgroups, seccomp
from pipeline.log import kv

log = logging.getLogger(__name__)
LAUNCHER = str(Path(__file__).with_name("_sandbox_launch.py"))
SETUP_FAILED = 121
STATUSES = ("ok", "runtime_error", "timeout", "cpu_limit", "output_limit", "setup_error")
BWRAP_TASKS = 1
"""Processes bubblewrap itself keeps in a run (its monitor)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (see ``libs.rewards.config.SandboxConfig`` for their meaning)."""

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
    isolation: str = "namespaces"  # built directly: the pre-bwrap behaviour; from_config: SandboxConfig's "auto"
    seccomp: bool = True
    bwrap: str = "bwrap"
    cgroup_parent: str | None = None

    def __post_init__(self):
        if self.isolation not in ("auto", "bwrap", "namespaces"):
            raise ValueError(f"sandbox isolation must be auto, bwrap or namespaces, not {self.isolation!r}")

    @classmethod
    def from_config(cls, cfg=None, **overrides) -> SandboxLimits:
        """From a SandboxConfig (default: ``SandboxConfig()``), with keyword overrides (unknown keys: TypeError)."""
        if cfg is None:
            from libs.rewards.config import SandboxConfig

            cfg = SandboxConfig()
        base = cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})
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


# ---- bubblewrap ---------------------------------------------------------------------------
@cache
def _prefixes(python: str) -> tuple[str, ...]:
    """The interpreter's prefixes (a venv and its base), bound read-only into the sandbox."""
    code = "import sys; print('\\n'.join({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}))"
    out = subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60, check=True)
    prefixes = {os.path.realpath(p) for p in out.stdout.splitlines()}
    return tuple(sorted(prefixes | {os.path.dirname(os.path.dirname(python))}))  # + a venv's own bin/..


def _bwrap_argv(lim: SandboxLimits, python: str, work: Path, seccomp_fd: int | None, json_fd: int) -> list[str]:
    # --as-pid-1: the program is its pid namespace's init, so its exit ends every process it left, and
    # bwrap's monitor reaps it (bwrap's own init would be orphaned, a zombie until PID 1 reaps it).
    argv = [shutil.which(lim.bwrap) or lim.bwrap, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session"]
    argv += ["--cap-drop", "ALL", "--hostname", "sandbox", "--proc", "/proc", "--dev", "/dev"]
    if lim.network == "allow":
        argv.append("--share-net")
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime"):
        argv += ["--ro-bind-try", f, f]
    for p in _prefixes(python):
        if p not in ("/", "/usr") and not p.startswith("/usr/"):
            argv += ["--ro-bind", p, p]
    argv += ["--bind", str(work), str(work), "--chdir", str(work), "--setenv", "TMPDIR", str(work)]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--json-status-fd", str(json_fd), "--remount-ro", "/", "--"]


@cache
def _bwrap_problem(lim: SandboxLimits) -> str | None:
    """Why bwrap cannot run programs here with these settings (None: it can); probed once."""
    if not shutil.which(lim.bwrap):
        return f"{lim.bwrap} not found (install bubblewrap: scripts/setup-infra-tools.sh)"
    if lim.seccomp and (why := seccomp.available()):
        return f"no seccomp filter ({why}); set seccomp = false to run bwrap without one"
    try:
        res = _run(lim, "print('ok')", "", "bwrap")
    except (OSError, subprocess.SubprocessError) as exc:  # e.g. the interpreter does not start
        return f"bwrap probe failed: {exc}"
    if res.status != "ok" or res.stdout != "ok\n":
        return f"bwrap probe failed ({res.status}): {res.stderr.strip()[-300:]}"
    return None


@cache
def _warn_fallback(reason: str) -> None:
    log.warning(
        "SANDBOX FALLBACK: bubblewrap isolation unavailable (%s); code runs with rlimits + namespaces only "
        "(no seccomp, host filesystem readable). Set reward.sandbox.require_isolation=true to refuse instead.",
        reason,
    )


# ---- running -------------------------------------------------------------------------------
def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None) -> RunResult:
    """Run ``source`` as a Python program with ``stdin``; never raises for what the program does."""
    lim = limits or SandboxLimits()
    python = _interpreter(lim.python, sandbox_uid(lim) is not None)
    if not os.access(python, os.X_OK):
        return RunResult("setup_error", None, "", f"sandbox: cannot exec {python}: not an executable file", 0.0)
    if lim.isolation == "namespaces":
        return _run(lim, source, stdin, "namespaces")
    problem = _bwrap_problem(replace(lim, wall_s=max(lim.wall_s, 30.0), cpu_s=max(lim.cpu_s, 10)))
    if problem is None:
        return _run(lim, source, stdin, "bwrap")
    if lim.isolation == "bwrap" or lim.require_isolation:
        return RunResult("setup_error", None, "", f"sandbox: bwrap isolation required but unavailable: {problem}", 0.0)
    _warn_fallback(problem)
    res = _run(lim, source, stdin, "namespaces")
    res.isolation["fallback"] = problem
    return res


def _run(lim: SandboxLimits, source: str, stdin: str, mode: str) -> RunResult:
    uid = sandbox_uid(lim)
    bwrap = mode == "bwrap"
    base = Path(tempfile.mkdtemp(prefix="rlstream-sbx-"))
    work, io_dir = base / "work", base / "io"
    work.mkdir()
    io_dir.mkdir(mode=0o700)
    t0 = time.monotonic()
    parent_fds: list[int] = []  # read ends this process keeps
    child_fds: list[int] = []  # ends handed to the launcher (and through it to bwrap)
    cg = None
    try:
        (work / "main.py").write_text(source)
        (io_dir / "stdin").write_text(stdin)
        if uid is not None:
            os.chmod(base, 0o711)
            for p in (work, work / "main.py"):
                os.chown(p, uid, uid)
            os.chmod(work, 0o700)
        extra = BWRAP_TASKS if bwrap else 0
        nproc = (lim.max_processes if uid is not None else _user_tasks(os.getuid()) + lim.max_processes) + extra
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
        parent_fds.append(status_r)
        child_fds.append(status_w)
        argv = [python, *lim.python_flags, str(work / "main.py")]
        json_r = None
        if bwrap:
            json_r, json_w = os.pipe()  # bwrap's --json-status-fd: child-pid once started, then exit-code
            parent_fds.append(json_r)
            child_fds.append(json_w)
            sec_r = None
            if lim.seccomp:
                sec_r, sec_w = os.pipe()  # the filter is far smaller than a pipe's buffer
                child_fds.append(sec_r)
                os.write(sec_w, seccomp.bpf_program(lim.network == "deny"))
                os.close(sec_w)
            argv = _bwrap_argv(lim, python, work, sec_r, json_w) + argv
        cg = cgroups.make_cgroup(lim, extra)
        spec = {
            "status_fd": status_w,
            "mode": mode,
            "deny_network": lim.network == "deny",
            "require_isolation": lim.require_isolation,
            "rlimits": rlimits,
            "cgroup": str(cg) if cg else None,
            "uid": uid,
            "ppid": os.getpid(),
            "argv": argv,
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
                    pass_fds=tuple(child_fds),
                )
            finally:
                while child_fds:
                    os.close(child_fds.pop())
            timed_out, early = False, ""
            try:
                proc.wait(timeout=lim.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                if json_r is not None:
                    early = _stop_bwrap_child(proc, json_r)
            finally:
                _kill_all(proc.pid, uid)
                proc.wait()
        raw_status = _read_fd(status_r)
        bwrap_events = [json.loads(line) for line in (early + _read_fd(json_r)).splitlines()] if json_r else []
        wall = time.monotonic() - t0
        oom = cgroups.remove_cgroup(cg) if cg else False
        cg = None
        isolation = json.loads(raw_status) if raw_status else {}
        isolation.update(sandbox=mode, seccomp=bwrap and lim.seccomp, cgroup=bool(isolation.get("cgroup")))
        stdout, out_size = _read_capped(io_dir / "stdout", lim.max_output_bytes)
        stderr, err_size = _read_capped(io_dir / "stderr", lim.max_output_bytes)
        rc = proc.returncode
        started = not bwrap or any("child-pid" in e for e in bwrap_events)
        if bwrap and started:
            code = next((e["exit-code"] for e in bwrap_events if "exit-code" in e), rc)
            rc = -(code - 128) if code is not None and code > 128 else code  # shell encoding: 128 + signal
        exec_failed = rc == SETUP_FAILED + 1 and stderr.startswith("sandbox: cannot exec")
        if "error" in isolation or exec_failed or (not raw_status and not timed_out) or (not started and not timed_out):
            status = "setup_error"
            stderr = isolation.get("error") or stderr or f"launcher exited {rc} before starting the program"
        elif timed_out:
            status = "timeout"
        elif max(out_size, err_size) >= lim.max_output_bytes or rc == -signal.SIGXFSZ:
            status = "output_limit"
        elif oom:
            status, stderr = "runtime_error", stderr + "\nsandbox: killed by the cgroup memory limit"
        elif rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and not timed_out):
            status = "cpu_limit"
        elif rc != 0:
            status = "runtime_error"
        else:
            status = "ok"
        return RunResult(status, rc, stdout, stderr[-4000:], wall, isolation)
    finally:
        for fd in parent_fds + child_fds:
            os.close(fd)
        if cg:
            cgroups.remove_cgroup(cg)
        shutil.rmtree(base, ignore_errors=True)


def _stop_bwrap_child(proc: subprocess.Popen, json_r: int) -> str:
    """At the wall limit, SIGKILL the program (its pid namespace's init, so everything in the
    namespace dies with it) and let bwrap reap it, so no zombie is left for PID 1 to reap. Returns
    what bwrap wrote on its status fd so far (its ``child-pid`` line)."""
    os.set_blocking(json_r, False)
    try:
        early = os.read(json_r, 65536).decode()
    except BlockingIOError:
        early = ""
    finally:
        os.set_blocking(json_r, True)
    for line in early.splitlines():
        pid = json.loads(line).get("child-pid")
        try:
            with open(f"/proc/{pid}/stat") as f:
                if pid and int(f.read().rpartition(")")[2].split()[1]) == proc.pid:  # still bwrap's child
                    os.kill(pid, signal.SIGKILL)
                    proc.wait(timeout=2)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    return early


def _read_fd(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


@cache
def capabilities(limits: SandboxLimits | None = None) -> dict:
    """Which protections a run gets here (probed once): the isolation mode, network isolation, the
    uid drop, seccomp and cgroup limits. Default: the ``code`` reward's defaults (``SandboxConfig()``)."""
    lim = replace(limits or SandboxLimits.from_config(), wall_s=20.0)
    res = run_python("print('ok')", limits=lim)
    caps = {
        "sandbox": res.isolation.get("sandbox", "unknown"),
        "fallback": res.isolation.get("fallback"),
        "network": res.isolation.get("network", "unknown"),
        "uid_drop": bool(_is_root() and res.isolation.get("uid") not in (None, 0)),
        "seccomp": bool(res.isolation.get("seccomp")),
        "cgroup": bool(res.isolation.get("cgroup")),
        "probe": res.status,
    }
    log.info("sandbox capabilities %s", kv(**caps))
    return caps
