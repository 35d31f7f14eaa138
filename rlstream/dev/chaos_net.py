"""Network faults of ``rlstream chaos``: a role (or every rollout worker at once) cut off from the
broker, slowed by latency, or its connections reset, through a ``FaultProxy`` in front of the local
broker (``rlstream.dev.faultproxy``).

``front(broker)`` starts the proxy and has the broker advertise it; call it before the broker
starts, and ``close()`` the proxy after the broker stops (the audit reads through it too).
``NetFaults`` is one fault class of the harness (``kinds`` ``partition``, ``latency``, ``reset``):

* ``partition``: no byte passes between the target's processes and the broker for ``arg`` seconds
  (connections stay open, new ones hang). Every other partition lasts past the role's session
  timeout, so its group really loses the member and gives its partitions to the others; the role
  comes back as a member that must rejoin, its uncommitted work redone by whoever owns it now. The
  target ``rollouts`` cuts every rollout worker at once;
* ``latency``: ``LATENCY_S`` +- ``JITTER_S`` each way (``2 x`` that per round trip) for ``arg`` s;
* ``reset``: every connection of the target closed with an RST (``arg`` s: new ones too).

Each fault done is a dict in ``done`` (``kind``, ``target``, ``t``, ``seconds``, ``seen``: what the
target roles logged about it (lost partitions, refused commits, librdkafka's timeouts and
disconnects) and the fault lines they said). What this is not: the proxy itself, a scheduler (the
harness calls ``do`` when a fault is due and ``poll`` often), nor an audit (``rlstream audit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlstream.dev.chaos_faults import log_lines, log_size
from rlstream.dev.chaos_plan import Fault
from rlstream.dev.faultproxy import FaultProxy, Rule

PARTITION_TARGETS = ["rollout-0", "rollouts", "reward-0", "rollout-1", "reward-1", "trainer"]
"""In the order a size's partitions take them (the first: one rollout worker past its session
timeout, the second: every rollout worker at once), then at random."""
LATENCY_TARGETS = ["rollout-0", "reward-1", "trainer", "all"]
RESET_TARGETS = ["rollout-1", "reward-0", "trainer", "rollout-0"]
LATENCY_S, JITTER_S = 0.1, 0.05
"""A ``latency`` fault's delay each way: 200 ms +- 100 ms per round trip."""
SEEN_S = 30.0
"""After a fault ends, its roles' logs are read this long for what they said about it."""
SEEN_MARKS = ("partitions lost", "revoked", "fenced", "could not commit", "timed out", "Timed out", "REQTMOUT",
              "transport failure", "Disconnected", "MAXPOLL", "max.poll", "rebalance", "not reach", "paused",
              "resumed", "was stopped for", "unreachable")  # fmt: skip
SEEN_MAX = 30

_FRONTS: dict[int, FaultProxy] = {}


def front(broker) -> FaultProxy | None:
    """A fault proxy in front of ``broker`` (a ``LocalBroker`` not yet started): the broker then
    advertises the proxy's port. None for a broker that cannot be fronted (a cluster)."""
    if broker is None or not hasattr(broker, "advertised_port"):
        return None
    host = broker.cfg.host

    def upstream() -> tuple[str, int]:  # the client listener of the broker's latest start (its state
        # is written only once it answers, and the start's own readiness check comes through here)
        for line in (broker.data_dir / "server.properties").read_text().splitlines():
            if line.startswith("listeners="):
                return host, int(line.split(",")[0].rsplit(":", 1)[1])
        raise OSError(f"no listeners in {broker.data_dir / 'server.properties'}")

    proxy = FaultProxy(upstream, host=host)
    broker.advertised_port = proxy.port
    _FRONTS[id(broker)] = proxy
    return proxy


def proxy_for(broker) -> FaultProxy | None:
    """The proxy ``front`` put in front of ``broker``, if any."""
    return _FRONTS.get(id(broker))


@dataclass
class _Active:
    fault: Fault
    names: list[str]
    rule: Rule
    t: float
    until: float
    logs: dict = field(default_factory=dict)
    """Role -> (log path, size at the start)."""
    faults_from: int = 0
    entry: dict = field(default_factory=dict)
    ended: float | None = None


class NetFaults:
    kinds = ("partition", "latency", "reset")

    def __init__(self, ctx):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.done: list[dict] = []
        self._active: list[_Active] = []
        self._reading: list[_Active] = []
        self._t = 0.0
        ops = ctx.broker_ops
        self.proxy = proxy_for(getattr(ops, "broker", None))
        if self.proxy is not None:
            self.proxy.identify = self._name_of

    def _name_of(self, pid: int) -> str | None:
        sup = getattr(self.ctx.launcher, "sup", None)
        return None if sup is None else sup.name_of(pid)

    # -- planning --------------------------------------------------------------------------------
    def session_s(self, target: str) -> float:
        """The session timeout of the group ``target`` is a member of (the trainer: the longest)."""
        reward, rollout = self.cfg.reward.session_timeout_ms / 1000, self.cfg.rollout.session_timeout_ms / 1000
        return (
            reward if target.startswith("reward") else rollout if target.startswith("rollout") else max(reward, rollout)
        )

    def plan(self, p: dict, rng, duration_s: float) -> list[Fault]:
        """``p["partitions"]`` partitions (every other one past the target's session timeout),
        ``p["net_latency"]`` latency faults and ``p.get("net_resets")`` resets, between 10 % and 80 %
        of the chaos phase."""
        faults = []
        for i in range(p.get("partitions", 0)):
            target = PARTITION_TARGETS[i] if i < len(PARTITION_TARGETS) else rng.choice(PARTITION_TARGETS)
            session = self.session_s(target)
            seconds = session + rng.uniform(5, 15) if i % 2 == 0 else rng.uniform(2, max(3.0, session / 2))
            faults.append(Fault(rng.uniform(0.1, 0.8) * duration_s, "partition", target, arg=round(seconds, 1)))
        for i in range(p.get("net_latency", 0)):
            target = LATENCY_TARGETS[i % len(LATENCY_TARGETS)]
            faults.append(
                Fault(rng.uniform(0.1, 0.8) * duration_s, "latency", target, arg=round(rng.uniform(10, 30), 1))
            )
        for i in range(p.get("net_resets", 0)):
            target = RESET_TARGETS[i % len(RESET_TARGETS)]
            faults.append(Fault(rng.uniform(0.1, 0.8) * duration_s, "reset", target, arg=0.0))
        return faults

    # -- running ---------------------------------------------------------------------------------
    def _names(self, sup, target: str) -> list[str]:
        if target == "all":
            return sorted(sup.children)
        if target == "rollouts":
            return sorted(n for n in sup.children if n.startswith("rollout-"))
        return [target] if target in sup.children else []

    def do(self, f: Fault, t: float) -> str | None:
        self._t = t
        if self.proxy is None:
            line = f"skipped: {f.kind} of {f.target}: no fault proxy in front of the broker (--bootstrap, or a cluster)"
            self.ctx.say(line)
            return line
        sup = getattr(self.ctx.launcher, "sup", None)
        if sup is None:
            return None
        names = self._names(sup, f.target)
        if not names:
            line = f"skipped: {f.target} not in this run"
            self.ctx.say(line)
            return line
        if any(set(names) & set(a.names) for a in self._active if a.fault.kind == f.kind):
            return None  # a fault of this kind holds one of them: a bit later
        if f.kind == "partition":  # shorter than the launcher's hang verdict (no metrics reach it)
            f.arg = min(f.arg, max(1.0, getattr(self.ctx.launcher, "hang_after_s", 1e9) - 20))
        if f.kind == "partition":
            rule = self.proxy.fault("partition", names)
            past = f.arg > self.session_s(names[0])
            line = (f"network partition of {f.target} ({', '.join(names)}) from the broker for {f.arg:.0f} s"
                    f"{' (past its group session timeout: the group drops it)' if past else ''}")  # fmt: skip
        elif f.kind == "latency":
            rule = self.proxy.fault("latency", names, delay_s=LATENCY_S, jitter_s=JITTER_S)
            line = (f"network latency {2000 * LATENCY_S:.0f} +- {2000 * JITTER_S:.0f} ms per round trip "
                    f"for {f.target} for {f.arg:.0f} s")  # fmt: skip
        else:
            n = len(self.proxy.connections_of(Rule("reset", frozenset(names), None)))
            rule = self.proxy.fault("reset", names, seconds=f.arg or None)
            line = f"reset {n} connection(s) of {f.target} to the broker" + (
                f" (and new ones for {f.arg:.0f} s)" if f.arg else ""
            )
            if not f.arg:
                self.proxy.clear(rule)
        a = _Active(f, names, rule, t, t + (f.arg or 0.0), faults_from=len(_fault_log(self.ctx.launcher)))
        for n in names:
            c = sup.children.get(n)
            if c is not None:
                a.logs[n] = (c.log_path, log_size(c.log_path))
        a.entry = {"kind": f.kind, "target": f.target, "t": round(t, 1), "seconds": None, "seen": []}
        self._active.append(a)
        self.ctx.say(line)
        return line

    def poll(self, t: float) -> None:
        self._t = t
        for a in list(self._active):
            if t >= a.until:
                self._end(a, t, f"{a.fault.kind} of {a.fault.target} ended after {t - a.t:.0f} s")
        for a in list(self._reading):
            a.entry["seen"] += self._seen(a)
            if t - a.ended > SEEN_S:
                self._reading.remove(a)

    def _seen(self, a: _Active) -> list[str]:
        room = SEEN_MAX - len(a.entry["seen"])
        out: list[str] = []
        for name, (path, start) in a.logs.items():
            out += [f"{name}: {s}" for s in log_lines(path, start, SEEN_MARKS, a.entry["seen"] + out, SEEN_MAX)]
        for e in _fault_log(self.ctx.launcher)[a.faults_from :]:
            line = f"{e.get('worker')}: {e.get('text')} (said on screen)"
            if any(str(e.get("worker", "")).startswith(n) for n in a.names) and line not in a.entry["seen"] + out:
                out.append(line)
        return out[: max(0, room)]

    def _end(self, a: _Active, t: float, line: str) -> None:
        self.proxy.clear(a.rule)
        self._active.remove(a)
        a.ended, a.entry["seconds"] = t, round(t - a.t, 1)
        a.fault.outcome = a.fault.outcome or line
        self.done.append(a.entry)
        self._reading.append(a)
        if a.fault.kind != "reset" or a.fault.arg:
            self.ctx.say(line)

    @property
    def busy(self) -> bool:
        return bool(self._active)

    def close(self) -> None:
        """Heal every network fault now (the proxy itself stays: the audit reads through it)."""
        for a in list(self._active):
            self._end(a, self._t, f"{a.fault.kind} of {a.fault.target} ended early: the harness is exiting")
        if self.proxy is not None:
            self.proxy.clear()


def _fault_log(launcher) -> list[dict]:
    progress = getattr(launcher, "progress", None)
    return list(getattr(progress, "fault_log", None) or [])
