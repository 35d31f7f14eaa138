"""Process faults of ``rlstream chaos`` beyond kill -9: a role frozen with SIGSTOP (some past its
consumer group's session timeout: it wakes as a zombie that still believes it owns its partitions
and its open transaction) and a role killed by the kernel's OOM killer.

``ProcessFaults`` is one fault class of the harness (``kinds`` ``stop`` and ``oom``):

* ``stop``: SIGSTOP the role for ``arg`` seconds, then SIGCONT. Every other stop lasts past the
  role's session timeout (``reward.session_timeout_ms``, ``rollout.session_timeout_ms``; the
  trainer's lock and checkpoint are what guard its steps), so the group moves its partitions and
  the woken role finds its commit refused (a reward worker says ``could not commit: ...`` and goes
  on, or exits for a restart when the broker aborted its transaction meanwhile); the others are
  shorter than it. A stop is said on screen when it begins and when it ends;
* ``oom``: stop the role (SIGTERM: it ends its batch and exits cleanly) and have the supervisor
  restart it under a memory limit below what a role needs to start (``Supervisor.limit_memory``
  with ``until_oom``: a memory cgroup, or RLIMIT_AS where no cgroup can be had). The kernel's OOM
  killer kills it while it starts (under RLIMIT_AS it dies of a MemoryError), the supervisor says
  ``<role> was killed by the kernel's OOM killer (memory limit N MB); restarting``, and the next
  restart runs without the limit. A running role is not limited in place: a cgroup counts only
  what is allocated after a process joins it, and a working role mostly reuses the memory it has
  (a reward worker put under a fresh 8 MB limit scores on for minutes). A role that is not killed
  within ``OOM_WAIT_S`` has the limit lifted, and the fault says so.

Each fault done is a dict in ``done`` (``kind``, ``target``, ``t``, ``seconds``, ``seen``: the
role's own lines about it: its watchdog's ``was stopped for``, a refused commit, a lost partition,
the supervisor's exit cause). What this is not: a scheduler (the harness calls ``do`` when a fault
is due and ``poll`` often), nor an audit (``rlstream audit`` checks the data afterwards).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from rlstream.dev.chaos_faults import log_lines, log_size
from rlstream.dev.chaos_plan import Fault

STOP_TARGETS = ["reward-0", "rollout-0", "trainer", "reward-1", "rollout-1"]
"""In the order a size's stops take them (the first: the zombie reward worker), then at random."""
OOM_TARGETS = ["reward-1", "rollout-1", "reward-0", "rollout-0"]
OOM_LIMIT_MB = 24
"""The limit an ``oom`` fault restarts a role under: below what any role allocates to start."""
OOM_WAIT_S = 90.0
"""An ``oom`` fault whose role is not killed within this long has its limit lifted (outcome said)."""
SEEN_S = 30.0
"""After a fault ends, its role's log is read this long for what it said about it."""
SEEN_MARKS = ("was stopped for", "could not commit", "partitions lost", "fenced", "MemoryError", "restart")


@dataclass
class _Active:
    fault: Fault
    target: str
    pid: int
    t: float
    until: float
    log_path: object
    log_from: int
    events_from: int = 0
    entry: dict = field(default_factory=dict)
    ended: float | None = None


class ProcessFaults:
    """The ``stop`` and ``oom`` faults of a chaos run (module docstring); ``ctx``: a
    ``rlstream.dev.chaos_faults.ChaosContext``."""

    kinds = ("stop", "oom")

    def __init__(self, ctx):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.done: list[dict] = []
        self._active: dict[str, _Active] = {}
        """Target -> its fault in force (one at a time per role)."""
        self._reading: list[_Active] = []
        """Ended faults whose role's log is still read for what it said (``SEEN_S``)."""
        self._t = 0.0
        """The harness's time at the last ``do`` or ``poll``."""

    # -- planning --------------------------------------------------------------------------------
    def session_s(self, target: str) -> float:
        """The session timeout of the group ``target`` is a member of (the trainer: the longest)."""
        reward, rollout = self.cfg.reward.session_timeout_ms / 1000, self.cfg.rollout.session_timeout_ms / 1000
        return (
            reward if target.startswith("reward") else rollout if target.startswith("rollout") else max(reward, rollout)
        )

    def plan(self, p: dict, rng, duration_s: float) -> list[Fault]:
        """``p["stops"]`` stops (every other one past the target's session timeout) and ``p["ooms"]``
        OOM kills, between 10 % and 80 % of the chaos phase."""
        faults = []
        for i in range(p.get("stops", 0)):
            target = STOP_TARGETS[i % len(STOP_TARGETS)] if i < len(STOP_TARGETS) else rng.choice(STOP_TARGETS)
            session = self.session_s(target)
            seconds = session + rng.uniform(5, 15) if i % 2 == 0 else rng.uniform(2, max(3.0, session / 2))
            faults.append(Fault(rng.uniform(0.1, 0.8) * duration_s, "stop", target, arg=round(seconds, 1)))
        for i in range(p.get("ooms", 0)):
            target = OOM_TARGETS[i % len(OOM_TARGETS)]
            faults.append(Fault(rng.uniform(0.1, 0.8) * duration_s, "oom", target, arg=OOM_LIMIT_MB))
        return faults

    # -- running ---------------------------------------------------------------------------------
    def _resolve(self, target: str) -> str:
        """The process to strike for ``target``: with a trainer standby, the trainer that holds the
        checkpoint dir now (never the idle one)."""
        if target != "trainer" or not self.cfg.job.trainer_standby:
            return target
        from consumers.trainer.state import TrainerCheckpoints, trainer_root

        return self.ctx.launcher.sup.name_of(TrainerCheckpoints(trainer_root(self.cfg)).holder()) or target

    def do(self, f: Fault, t: float) -> str | None:
        sup, self._t = self.ctx.launcher.sup, t
        target = self._resolve(f.target) if sup is not None else f.target
        if target in self._active or sup is None or not sup.alive(target):
            return None  # restarting, or a fault of ours holds it: a bit later
        c = sup.children[target]
        pid = c.proc.pid
        if f.kind == "stop":  # shorter than the launcher's hang verdict (no metrics for hang_after_s)
            f.arg = min(f.arg, max(1.0, getattr(self.ctx.launcher, "hang_after_s", 1e9) - 20))
        a = _Active(f, target, pid, t, t + f.arg, c.log_path, log_size(c.log_path))
        if f.kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            sup.event("signal", target, pid=pid, signal="SIGSTOP", cause=f"chaos stop {f.arg:.0f} s")
            past = f.arg > self.session_s(target)
            line = (
                f"SIGSTOP {target} (pid {pid}) for {f.arg:.0f} s"
                f"{' (past its group session timeout: a zombie when it wakes)' if past else ''}"
            )
        else:
            limit = sup.limit_memory(target, int(f.arg), running=False, until_oom=True)
            a.until, a.events_from = t + OOM_WAIT_S, len(sup.events)
            if sup.inject(target, signal.SIGTERM, cause="chaos oom: restarted under a memory limit") is None:
                sup.limit_memory(target, None)
                return None
            line = (
                f"SIGTERM {target} (pid {pid}); its restart runs under a memory limit of {f.arg:.0f} MB ({limit.kind})"
            )
        a.entry = {"kind": f.kind, "target": target, "t": round(t, 1), "seconds": None, "seen": []}
        self._active[target] = a
        self.ctx.say(line)
        return line

    def poll(self, t: float) -> None:
        sup, self._t = self.ctx.launcher.sup, t
        for target, a in list(self._active.items()):
            if a.fault.kind == "stop":
                if t >= a.until:
                    self._cont(a)
                    self._end(a, t, f"SIGCONT {target} after {t - a.t:.0f} s")
                continue
            died = _oom_exit(sup, target, a.events_from)
            if died is not None:  # the supervisor lifted the limit for the next restart (``until_oom``)
                a.entry["seen"].append(f"supervisor: {died.get('why')} (exit {died.get('code')})")
                self._end(a, t, f"{died.get('why')}; restarted without the limit")
            elif t >= a.until:
                if target in sup.children:
                    sup.limit_memory(target, None)
                self._end(a, t, f"{target} was not killed for memory within {OOM_WAIT_S:.0f} s; limit lifted")
        for a in list(self._reading):
            a.entry["seen"] += log_lines(a.log_path, a.log_from, SEEN_MARKS, a.entry["seen"], 20)
            if t - a.ended > SEEN_S:
                self._reading.remove(a)

    def _cont(self, a: _Active) -> None:
        try:
            os.kill(a.pid, signal.SIGCONT)
        except ProcessLookupError:  # killed while stopped (a hang verdict): it is restarted anyway
            a.entry["seen"].append("the process was gone before SIGCONT")
        sup = self.ctx.launcher.sup
        if sup is not None:
            sup.event("signal", a.target, pid=a.pid, signal="SIGCONT", cause="chaos stop ended")

    def _end(self, a: _Active, t: float, line: str) -> None:
        del self._active[a.target]
        a.ended, a.entry["seconds"] = t, round(t - a.t, 1)
        a.fault.outcome = a.fault.outcome or line
        self.done.append(a.entry)
        self._reading.append(a)
        self.ctx.say(line)

    @property
    def busy(self) -> bool:
        return bool(self._active)

    def close(self) -> None:
        """SIGCONT every stopped role and lift every memory limit, now."""
        sup = self.ctx.launcher.sup
        for a in list(self._active.values()):
            if a.fault.kind == "stop":
                self._cont(a)
            elif sup is not None and a.target in sup.children:
                sup.limit_memory(a.target, None)
            self._end(a, self._t, f"{a.fault.kind} of {a.target} ended early: the harness is exiting")


def _oom_exit(sup, name: str, since: int) -> dict | None:
    """The supervisor's first ``oom`` exit of ``name`` from event ``since`` on, if any."""
    events = sup.events[since:]
    return next((e for e in events if e["event"] == "exit" and e["name"] == name and e["cause"] == "oom"), None)
