"""cgroup v2 limits of one sandboxed run (``libs.rewards.sandbox``): find a writable cgroup with the
memory and pids controllers delegated (``reward.sandbox.cgroup_parent``, default the worker's own),
make a child cgroup per run (memory.max, pids.max, no swap), and kill and remove it afterwards,
saying whether the memory limit killed something."""

from __future__ import annotations

import logging
import os
import time
from functools import cache
from itertools import count
from pathlib import Path

log = logging.getLogger(__name__)
_run_ids = count()


def cgroup2_root() -> Path | None:
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                return Path(parts[1])
    return None


@cache
def cgroup_parent(configured: str | None) -> Path | None:
    """A writable cgroup v2 directory with memory and pids delegated to its children, else None
    (logged once). Default: the worker's own cgroup."""
    root = cgroup2_root()
    path = Path(configured) if configured else None
    if path is None and root is not None:
        with open("/proc/self/cgroup") as f:
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        path = root / own.lstrip("/") if own is not None else None
    try:
        enabled = (path / "cgroup.subtree_control").read_text().split() if path else []
    except OSError:
        enabled = []
    if path is None or not {"memory", "pids"} <= set(enabled) or not os.access(path, os.W_OK):
        log.info(
            "sandbox cgroup v2 limits off: %s has no writable memory+pids delegation (set reward.sandbox.cgroup_parent); "
            "memory and process limits rely on RLIMIT_AS and RLIMIT_NPROC",
            path or "no cgroup v2 mount",
        )
        return None
    return path


def make_cgroup(lim, extra_tasks: int) -> Path | None:
    """A child cgroup for one run with ``lim``'s (``SandboxLimits``) memory and process limits and no
    swap; None when cgroup v2 limits are off."""
    parent = cgroup_parent(lim.cgroup_parent)
    if parent is None:
        return None
    cg = parent / f"rlstream-sbx-{os.getpid()}-{next(_run_ids)}"
    try:
        cg.mkdir()
        (cg / "memory.max").write_text(str(lim.memory_mb << 20))
        (cg / "pids.max").write_text(str(lim.max_processes + extra_tasks))
        if (cg / "memory.swap.max").exists():
            (cg / "memory.swap.max").write_text("0")
    except OSError as exc:
        log.warning("sandbox: cannot set up cgroup %s (%s); this run has no cgroup limits", cg, exc)
        remove_cgroup(cg)
        return None
    return cg


def remove_cgroup(cg: Path) -> bool:
    """Kill what is left in the run's cgroup and remove it; True if its memory limit killed something."""
    oom = False
    try:
        events = dict(line.split() for line in (cg / "memory.events").read_text().splitlines() if line.strip())
        oom = int(events.get("oom_kill", 0)) > 0
        (cg / "cgroup.kill").write_text("1")  # kernel 5.14+
    except OSError:
        pass
    for _ in range(100):  # the kill is asynchronous
        try:
            cg.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.02)
    return oom
