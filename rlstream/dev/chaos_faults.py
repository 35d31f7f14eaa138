"""The fault classes of ``rlstream chaos`` beyond kill -9, broker faults, joins and bad records: the
registry (``FAULT_CLASSES``, imported lazily by name), the context every class is built with
(``ChaosContext``) and the handful of calls the harness makes on all of them at once (``FaultClasses``).

A fault class lives in its own module under ``rlstream/dev`` and has ``kinds`` (the ``Fault.kind``
values it runs), ``__init__(ctx)``, ``plan(p, rng, duration_s)`` (its faults for a size's params),
``do(fault, t)`` (start it: its outcome line, or None to try again a bit later), ``poll(t)`` (end the
faults whose time is up), ``busy`` (one of its faults is in force) and ``close()`` (end every fault
now: the harness is exiting), and records each fault it did in ``done``
(``{"kind", "target", "t", "seconds", "seen"}``). A module may also have ``settings(run_dir)``: config
settings a run with its faults needs (the run's own settings, applied before any role starts), and
``front(broker)``: put something in front of the harness's own broker before it starts (the network
faults' proxy), returning an object whose ``close()`` the harness calls after the broker stops.

Not the schedule of the other faults (``rlstream.dev.chaos_plan``) nor the harness's loop
(``rlstream.dev.chaos``), and it judges nothing (``rlstream.dev.chaos_audit``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlstream.dev.chaos_plan import Fault

log = logging.getLogger(__name__)

FAULT_CLASSES = {  # name -> (module, class, the size params that count its faults)
    "net": ("rlstream.dev.chaos_net", "NetFaults", ("partitions", "net_latency", "net_resets")),
    "storage": ("rlstream.dev.chaos_storage", "StorageFaults", ("storage_faults",)),
    "process": ("rlstream.dev.chaos_process", "ProcessFaults", ("stops", "ooms")),
}
"""The fault classes the harness runs, imported when a run starts. A class whose module is not
installed is left out (said once); a module that exists but fails to import fails the run."""
COUNT_KEYS = tuple(k for _, _, keys in FAULT_CLASSES.values() for k in keys)
"""Every size param that counts a class's faults (``chaos_plan.SIZES``, the ``rlstream chaos`` options)."""


@dataclass
class ChaosContext:
    """What a fault class is built with."""

    cfg: Any
    """The run's resolved config (``rlstream.config.Config``)."""
    launcher: Any
    """The run's launcher (``launcher.sup``: the supervisor of the roles; ``launcher.progress``: the
    roles' metrics, ``progress.fault_log`` the fault lines they said). Set before the first ``do``."""
    run_dir: Any
    """The run directory (its ``logs/`` hold each role's log)."""
    broker_ops: Any
    """The broker's operations (``rlstream.dev.chaos_broker.BrokerOps``): ``broker`` None with ``--bootstrap``."""
    say: Callable[[str], None]
    """Print one progress line (``[chaos] ...``) on the harness's console."""
    rng: Any
    """The class's own seeded ``random.Random``."""


def available() -> dict[str, type]:
    """name -> class of every fault class whose module is installed."""
    out = {}
    for name, (module, cls, _) in FAULT_CLASSES.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # the module is there but something it imports is not: loud
                raise
            continue
        out[name] = getattr(mod, cls)
    return out


def run_settings(run_dir, p: dict) -> dict:
    """The settings the run's classes with planned faults need (each module's ``settings(run_dir)``)."""
    out = {}
    for name, (module, _, keys) in FAULT_CLASSES.items():
        if name in available() and any(p.get(k) for k in keys):
            fn = getattr(importlib.import_module(module), "settings", None)
            out.update(fn(run_dir) if fn else {})
    return out


def fronts(broker, p: dict) -> list:
    """What the classes with planned faults put in front of ``broker`` (not yet started: each
    module's ``front(broker)``); the harness closes each after the broker stops."""
    out = []
    for name, (module, _, keys) in FAULT_CLASSES.items():
        if broker is not None and name in available() and any(p.get(k) for k in keys):
            fn = getattr(importlib.import_module(module), "front", None)
            if fn is not None and (obj := fn(broker)) is not None:
                out.append(obj)
    return out


class FaultClasses:
    """Every installed fault class of a run, with its faults planned."""

    def __init__(self, ctx: ChaosContext, p: dict, duration_s: float, seed: int):
        import random

        self.ctx, self.classes, self.faults, self.closed = ctx, [], [], False
        self.by_kind: dict[str, Any] = {}
        found = available()
        for i, name in enumerate(FAULT_CLASSES):
            keys = FAULT_CLASSES[name][2]
            if name not in found:
                if any(p.get(k) for k in keys):
                    ctx.say(f"{name} faults planned but {FAULT_CLASSES[name][0]} is not installed: none run")
                continue
            rng = random.Random(seed * 1000 + 17 + i)
            obj = found[name](ChaosContext(**{**vars(ctx), "rng": rng}))
            self.classes.append(obj)
            for kind in obj.kinds:
                self.by_kind[kind] = obj
            planned = obj.plan(p, rng, duration_s)
            self.faults += planned
            if planned:
                log.info(
                    "%s faults planned: %s", name, ", ".join(f"{f.kind} {f.target} at {f.at:.0f}s" for f in planned)
                )

    def set_launcher(self, launcher) -> None:
        for c in self.classes:
            c.ctx.launcher = launcher
        self.ctx.launcher = launcher

    def owner(self, f: Fault):
        return self.by_kind.get(f.kind)

    def poll(self, t: float) -> None:
        for c in self.classes:
            c.poll(t)

    @property
    def busy(self) -> bool:
        return any(c.busy for c in self.classes)

    def busy_kinds(self) -> list[str]:
        return [k for c in self.classes if c.busy for k in c.kinds[:1]]

    def close(self) -> None:
        """Every class's ``close``, each one even when another fails (the first error is re-raised);
        once: a second call does nothing."""
        if self.closed:
            return
        self.closed, first = True, None
        for c in self.classes:
            try:
                c.close()
            except Exception as exc:  # the others must still end their faults; re-raised below
                log.exception("closing %s failed", type(c).__name__)
                first = first or exc
        if first is not None:
            raise first

    def done(self) -> list[dict]:
        """Every fault the classes did (their ``done`` records), in time order."""
        return sorted((d for c in self.classes for d in c.done), key=lambda d: d.get("t") or 0.0)


def log_size(path) -> int:
    """The size of a role's log now (0 if there is none yet): where to read its new lines from."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def log_lines(path, start: int, marks, already: list[str], most: int) -> list[str]:
    """At most ``most`` lines of a role's log from byte ``start`` that contain one of ``marks`` (what
    a role said about a fault), each cut to 300 characters, not yet in ``already``."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            text = fh.read(4_000_000).decode(errors="replace")
    except OSError:
        return []
    out: list[str] = []
    for line in text.splitlines():
        line = line.strip()[:300]
        if any(m in line for m in marks) and line not in already and line not in out:
            out.append(line)
    return out[:most]
