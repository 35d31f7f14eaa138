"""What the launcher says of a role that is alive but not moving, so a fault it cannot say itself
is on screen while it lasts:

* **stopped**: its process is stopped (SIGSTOP, a debugger, a paused container: state ``T`` in
  ``/proc/<pid>/stat``): nothing of it runs, so its heartbeats stop and, past its session timeout,
  its group gives its partitions to the other members;
* **silent**: it runs, but its metrics stopped while the other roles' go on arriving: it cannot
  reach the brokers (a network partition, a firewall) or it is stuck; past ``hang_after_s`` the
  launcher takes it for hung and restarts it.

One line when it begins and one when it ends, in the run's fault log (``Progress.fault_log``,
report.json ``faults``) beside the faults the roles say themselves (``WorkerMetrics.set_fault``).
Read-only: it neither signals nor restarts anything (the supervisor and the hang check do).
"""

from __future__ import annotations

import time

QUIET_S = 15.0
"""A live role whose metrics stopped this long while the other roles' arrive is said silent (its
metrics come every ``metrics_interval_s``, 2 s by default; a trainer inside a long step sends
in-step progress)."""
RESUMED_GRACE_S = 10.0
"""A role that was stopped is not said silent this long after it runs again (its next metrics are
on their way)."""
STOPPED_AFTER_S = 2.0
"""A role is said stopped once its process has been seen stopped this long (a debugger's or a
profiler's short stop is not a fault)."""


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T`` ...), None if it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class RoleStates:
    """Says roles that stopped or went silent; ``check`` once per launcher loop."""

    def __init__(self, hang_after_s: float, quiet_s: float = QUIET_S):
        self.quiet_s, self.hang_after_s = quiet_s, hang_after_s
        self.resumed: dict[str, float] = {}
        """role -> monotonic time it was last seen running again after a stop."""
        self.stopped_since: dict[str, float] = {}
        """role -> monotonic time its process was first seen stopped."""
        self.open: dict[str, dict] = {}
        """role -> its fault-log record while the state lasts."""

    def check(self, pids: dict[str, int], quiet: dict[str, float], now_wall: float) -> list[tuple[dict, str]]:
        """``pids``: role -> pid of each live role; ``quiet``: role -> seconds since its last
        MetricEvent, for the live roles silent past ``quiet_s`` while others' arrive
        (``launcher.hung_roles``). Returns (fault-log record, line to say) for each change."""
        mono, out = time.monotonic(), []
        for name, pid in pids.items():
            if process_state(pid) in ("T", "t"):
                self.stopped_since.setdefault(name, mono)
            elif self.stopped_since.pop(name, None) is not None:
                self.resumed[name] = mono
        states = {name: "stopped" for name, t in self.stopped_since.items() if mono - t >= STOPPED_AFTER_S}
        for name, silent_s in quiet.items():
            if mono - self.resumed.get(name, -RESUMED_GRACE_S) >= RESUMED_GRACE_S:
                states.setdefault(name, f"silent:{silent_s}")
        for name in list(self.open):
            rec = self.open[name]
            if states.get(name, "").split(":")[0] != rec["state"]:
                rec["end"] = now_wall
                del self.open[name]
                what = "running again" if rec["state"] == "stopped" else "reporting again"
                out.append((rec, f"{what} after {now_wall - rec['start']:.0f} s (was: {rec['text']})"))
        for name, state in states.items():
            if name in self.open:
                continue
            if state == "stopped":
                since = now_wall - (mono - self.stopped_since[name])
                text = (
                    "its process is stopped (SIGSTOP or a paused process); past its session timeout its "
                    "partitions move to the other members"
                )
            else:
                silent_s = float(state.split(":")[1])
                since = now_wall - silent_s
                text = (
                    f"no metrics for {silent_s:.0f} s while the other roles report (cut off from the brokers, "
                    f"or stuck); taken for hung and restarted after {self.hang_after_s:.0f} s"
                )
            rec = self.open[name] = {"worker": name, "text": text, "start": since, "end": None,
                                     "state": state.split(":")[0]}  # fmt: skip
            out.append((rec, text))
        return out
