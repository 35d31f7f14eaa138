"""A memory limit on one supervised process, and the evidence that the kernel killed it for that.

``MemoryLimit.apply(pid, name, mb)`` puts a running process under a limit of ``mb`` MB, the
best way the machine allows:

* ``cgroup-v1``: a memory cgroup of its own under the supervisor's (``memory.limit_in_bytes``, and
  ``memory.memsw.limit_in_bytes`` so swap is no way around it); the kernel's OOM killer kills the
  process with SIGKILL when it goes over, and the cgroup's ``oom_kill`` counter
  (``memory.oom_control``) says that it did;
* ``cgroup-v2``: the same with ``memory.max`` / ``memory.swap.max`` and ``memory.events``;
* ``rlimit``: where no cgroup can be made (no permission, no memory controller), ``RLIMIT_AS`` on
  the process (``prlimit``): an allocation past it fails, Python raises MemoryError, and the role
  dies with its stack in its log. RLIMIT_AS counts address space, not memory: a process that maps
  much more than it touches (CUDA, some allocators) needs a larger limit than under a cgroup.

The limit follows the process only from the moment it is applied (a few milliseconds after the
start); ``attach`` puts a restarted process under the same limit. ``oom_killed`` reads the
counter: the supervisor names the cause of an exit with it (``why_dead``).

What this is not: a cgroup manager. It makes one cgroup per limited role, removes it with
``close``, and never changes the limits of anything else.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
from pathlib import Path

from pipeline.log import kv

log = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")
MB = 1024 * 1024


def _own_cgroup(controller: str | None) -> Path | None:
    """The directory of this process's cgroup: of ``controller`` (v1), or the unified one (None)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            base = CGROUP_ROOT / controller if controller else CGROUP_ROOT
            if controller is None and (CGROUP_ROOT / "unified" / "cgroup.controllers").exists():
                base = CGROUP_ROOT / "unified"
            d = base / path.lstrip("/")
            return d if d.is_dir() else None
    return None


class MemoryLimit:
    """One process's memory limit (module docstring); ``kind`` is ``cgroup-v1``, ``cgroup-v2`` or
    ``rlimit``, ``why_not_cgroup`` says why no cgroup was used (``rlimit`` only)."""

    def __init__(self, name: str, mb: int, kind: str, path: Path | None = None, why_not_cgroup: str = ""):
        self.name, self.mb, self.kind, self.path = name, mb, kind, path
        self.why_not_cgroup = why_not_cgroup
        self.pid: int | None = None
        """The process under the limit now (None: lifted, or none yet)."""
        self.restarts = True
        """The supervisor puts a restart of the process under it too."""
        self.until_oom = False
        """Only until a process under it is killed for it: the restarts after that run without it."""
        self._kills = self._oom_count()

    @classmethod
    def apply(cls, pid: int | None, name: str, mb: int) -> MemoryLimit:
        """Put ``pid`` under ``mb`` MB (None: none yet, ``attach`` later): a cgroup where one can be
        made, else RLIMIT_AS (logged)."""
        reasons = []
        for kind in ("cgroup-v1", "cgroup-v2"):
            try:
                path = _make_cgroup(kind, f"rlstream-{os.getpid()}-{name}", mb)
            except OSError as exc:
                reasons.append(f"{kind}: {exc.strerror or exc}")
                continue
            if path is not None:
                limit = cls(name, mb, kind, path)
                if pid is not None:
                    limit.attach(pid)
                return limit
            reasons.append(f"{kind}: no memory controller")
        why = "; ".join(reasons)
        log.warning(
            "no memory cgroup for this role; limiting its address space (RLIMIT_AS) instead %s",
            kv(name=name, limit_mb=mb, why=why),
        )
        limit = cls(name, mb, "rlimit", why_not_cgroup=why)
        if pid is not None:
            limit.attach(pid)
        return limit

    def attach(self, pid: int) -> None:
        """Put ``pid`` (the role, or its restart) under this limit."""
        if self.path is not None:
            if self.pid is None:  # lifted before: the limit again (the memory one first, as the kernel wants)
                _write_limits(self.kind, self.path, self.mb)
            (self.path / "cgroup.procs").write_text(str(pid))
        else:
            resource.prlimit(pid, resource.RLIMIT_AS, (self.mb * MB, self.mb * MB))
        self.pid = pid
        self._kills = self._oom_count()

    def _oom_count(self) -> int:
        """The cgroup's ``oom_kill`` counter (0 without a cgroup, or where the kernel has none)."""
        if self.path is None:
            return 0
        name = "memory.oom_control" if self.kind == "cgroup-v1" else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def why_dead(self, code: int | None, log_tail: str = "") -> str | None:
        """The line that says a process under this limit died of it (exit ``code`` as Popen gives
        it), or None if nothing says so: the cgroup's OOM kill counter went up, or (RLIMIT_AS) it
        was SIGKILLed or died of a MemoryError."""
        kills = self._oom_count()
        killed, self._kills = kills > self._kills, kills
        limit = f"memory limit {self.mb} MB"
        if killed:
            return f"{self.name} was killed by the kernel's OOM killer ({limit})"
        if self.kind != "rlimit":
            return None
        if code == -signal.SIGKILL:
            return f"{self.name} was killed by SIGKILL while under its {limit} (RLIMIT_AS): likely out of memory"
        if "MemoryError" in log_tail:
            return f"{self.name} ran out of memory ({limit}, RLIMIT_AS: MemoryError)"
        return None

    def lift(self) -> None:
        """Lift the limit of the process under it now (it runs on, unlimited); ``attach`` puts the
        limit back."""
        if self.kind == "cgroup-v1":
            for name in ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes"):  # memsw may not be below
                if (self.path / name).exists():
                    (self.path / name).write_text("-1")
        elif self.kind == "cgroup-v2":
            (self.path / "memory.max").write_text("max")
        elif self.pid is not None:
            inf = resource.RLIM_INFINITY
            try:
                resource.prlimit(self.pid, resource.RLIMIT_AS, (inf, inf))
            except ProcessLookupError:
                pass
        self.pid = None

    def describe(self) -> str:
        return f"{self.mb} MB ({self.kind}{f' at {self.path}' if self.path else ''})"

    def close(self) -> None:
        """Remove the cgroup (once its processes are gone; a busy one is left, logged)."""
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError as exc:
                log.warning("could not remove a role's memory cgroup %s", kv(path=self.path, error=exc))


def _make_cgroup(kind: str, leaf: str, mb: int) -> Path | None:
    """Make the cgroup ``leaf`` under this process's own and set its limit; None if this machine
    has no such memory controller; OSError (the cgroup removed again) if the kernel refuses."""
    if kind == "cgroup-v1":
        parent = _own_cgroup("memory")
        if parent is None or not (parent / "memory.limit_in_bytes").exists():
            return None
    else:
        parent = _own_cgroup(None)
        if parent is None or "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            return None
    path = parent / leaf
    path.mkdir(exist_ok=True)
    try:
        _write_limits(kind, path, mb)
    except OSError:
        path.rmdir()
        raise
    return path


def _write_limits(kind: str, path: Path, mb: int) -> None:
    """The limit, swap included where the kernel counts it (v1: memory first, then memory plus swap,
    which may not be below it; v2: no swap)."""
    files = (
        {"memory.limit_in_bytes": str(mb * MB), "memory.memsw.limit_in_bytes": str(mb * MB)}
        if kind == "cgroup-v1"
        else {"memory.max": str(mb * MB), "memory.swap.max": "0"}
    )
    for name, value in files.items():
        if name == "memory.limit_in_bytes" or name == "memory.max" or (path / name).exists():
            (path / name).write_text(value)
