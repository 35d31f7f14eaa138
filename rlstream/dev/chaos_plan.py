"""The plan of ``rlstream chaos``: the sizes, the options that override them, and the seeded fault
schedule (``plan_faults``). Pure: no broker, no process; ``rlstream.dev.chaos`` runs the plan.

The faults of the fault classes (network, storage, process: ``rlstream.dev.chaos_faults``) are
planned by each class from the size's counts (``partitions``, ``net_latency``, ``net_resets``,
``storage_faults``, ``stops``, ``ooms``).

Sizes: ``tiny`` (CI), ``full`` (the documented run) and ``scale`` (the audit at Kafka's test
scale: over 100,000 samples, at least three kill -9 of every role, all after 20 % of the chaos
phase, and, on its default three-node cluster, a SIGKILL of every broker; hours on two cores).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from rlstream.dev.chaos_broker import cluster_faults

SIZES = {
    "tiny": {
        "groups": 160,
        "duration_s": 90.0,
        "kills": 6,
        "trainer_kills": 1,
        "feed_kills": 1,
        "broker_restarts": 1,
        "joins": 1,
        "fuzz": 50,
        "long_down_s": 30.0,
        "partitions": 1,
        "net_latency": 1,
        "net_resets": 1,
        "storage_faults": 1,
        "stops": 1,
        "ooms": 1,
    },
    "full": {
        "groups": 1600,
        "duration_s": 1200.0,
        "kills": 56,
        "trainer_kills": 6,
        "feed_kills": 6,
        "broker_restarts": 2,
        "joins": 2,
        "fuzz": 1000,
        "long_down_s": 150.0,
        "partitions": 3,
        "net_latency": 3,
        "net_resets": 3,
        "storage_faults": 6,
        "stops": 4,
        "ooms": 3,
    },
    "scale": {
        "groups": 12_520,  # x the demo's group size 8: 100,160 samples
        # the feed spreads the groups over 80 % of the phase: 1.67 groups/s, the full size's rate
        # (which two loaded cores kept up with: drain ~100 s)
        "duration_s": 9400.0,
        "kills": 100,
        "trainer_kills": 10,
        "feed_kills": 5,
        "worker_kills": 3,  # each of rollout-0, rollout-1, reward-0, reward-1
        "kill_from": 0.2,  # no kill before 20 % of the chaos phase
        "broker_restarts": 3,  # on 3 nodes: a SIGKILL of each, then a pause and a rolling restart
        "joins": 4,
        "fuzz": 5000,
        "long_down_s": 300.0,
        "nodes": 3,
        "partitions": 10,
        "net_latency": 10,
        "net_resets": 10,
        "storage_faults": 20,
        "stops": 12,
        "ooms": 8,
    },
}
TASK_RECORDS = 10  # write_task's prompts; the feed cycles over them in epochs
BASE_ROLES = ["feed", "trainer", "rollout-0", "rollout-1", "reward-0", "reward-1"]
WORKERS = [r for r in BASE_ROLES if r.startswith(("rollout", "reward"))]
"""The workers a size's ``worker_kills`` applies to, each."""
KILL_FROM = 0.05
"""Earliest kill, as a fraction of the chaos phase (a size's ``kill_from`` overrides it)."""


@dataclass
class ChaosOptions:
    size: str = "tiny"
    seed: int = 0
    out: Path | None = None
    bootstrap: str | None = None
    groups: int | None = None
    duration_s: float | None = None
    kills: int | None = None
    trainer_kills: int | None = None
    feed_kills: int | None = None
    broker_restarts: int | None = None
    joins: int | None = None
    fuzz: int | None = None
    drain_s: float = 600.0
    warmup_s: float = 600.0
    keep_data: bool = False
    nodes: int | None = None
    """Brokers of the local cluster (3: hard faults of each node instead of restarts of one broker);
    None: the size's (3 for ``scale``, else 1; 1 with ``bootstrap``)."""
    standby: bool = False
    """Run the trainer with a hot standby (``job.trainer_standby``); a trainer kill then strikes
    whichever of the two trains at that moment (the holder of the checkpoint dir's lock)."""
    rollout_standby: bool = False
    """Run the rollout workers by slot with a warm spare (``job.rollout_standby``); a rollout kill
    then strikes the worker that holds the slot at that moment (``producers.slots``)."""
    docs: Path | None = None
    """A results page whose ``<!-- chaos:<size> -->`` block the run regenerates (``chaos_docs``)."""
    unpaced: bool = False
    """Feed as fast as admission allows (``feed.rate = 0``) instead of spreading the groups over the
    chaos phase: for availability figures (ETTR) with a trainer-bound setup (sim engines)."""
    partitions: int | None = None
    """Network partitions of a role from the broker (``rlstream.dev.chaos_net``); None: the size's."""
    net_latency: int | None = None
    """Spells of added network latency between a role and the broker; None: the size's."""
    net_resets: int | None = None
    """Resets (RST) of every connection of a role to the broker; None: the size's."""
    storage_faults: int | None = None
    """Weights store faults: a full disk, a slow then failing store, published weights deleted
    (``rlstream.dev.chaos_storage``); None: the size's."""
    stops: int | None = None
    """SIGSTOPs of a role, every other one past its group's session timeout, then SIGCONT
    (``rlstream.dev.chaos_process``); None: the size's."""
    ooms: int | None = None
    """Kills of a role by the kernel's OOM killer (a restart under a memory limit); None: the size's."""

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"unknown chaos size {self.size!r} (one of {', '.join(SIZES)})")
        if self.nodes is None:  # someone else's cluster (--bootstrap): no local nodes to fault
            self.nodes = 1 if self.bootstrap else SIZES[self.size].get("nodes", 1)

    def plan(self, groups_per_step: int) -> dict:
        """The size's numbers with the overrides; ``groups`` rounded up to a multiple of G and of
        the task's 10 prompts (so ``max_steps`` trains exactly the fed groups)."""
        p = {"worker_kills": 0, "kill_from": KILL_FROM, **SIZES[self.size]}
        p.update({k: v for k in p if (v := getattr(self, k, None)) is not None})
        unit = math.lcm(groups_per_step, TASK_RECORDS)
        p["groups"] = max(unit, -(-p["groups"] // unit) * unit)
        p["kills"] = max(p["kills"], p["trainer_kills"] + p["feed_kills"] + p["worker_kills"] * len(WORKERS))
        p["nodes"], p["unpaced"] = self.nodes, self.unpaced
        if self.bootstrap or self.nodes > 1:  # network faults need the proxy in front of our one broker
            p.update(partitions=0, net_latency=0, net_resets=0)
        if self.bootstrap:
            p["broker_restarts"] = 0
        elif self.nodes > 1 and self.broker_restarts == 0:
            pass  # asked for explicitly: a cluster without broker faults (role kills only: availability)
        elif self.nodes > 1:  # every node killed once (one for minutes), a pause, a rolling restart
            p["broker_restarts"] = max(p["broker_restarts"], self.nodes) + 2
        return p


@dataclass
class Fault:
    at: float
    """Seconds into the chaos phase (a fault that cannot happen yet is moved later)."""
    kind: str
    """kill | broker | join | leave | fuzz, or a kind of a fault class (``chaos_faults.FAULT_CLASSES``)"""
    target: str = ""
    arg: float = 0.0
    required: bool = False
    """A kill that counts towards a role's minimum (never moved to another role)."""
    outcome: str | None = None
    t_done: float | None = None


def plan_faults(p: dict, rng: random.Random, duration: float) -> list[Fault]:
    """The seeded schedule. Kills fall from ``kill_from`` of the phase on; the feed's while it
    still feeds (up to 55 %), the trainer's up to 85 %, the workers' up to 90 %."""
    d, f0 = duration, p.get("kill_from", KILL_FROM)
    faults = [Fault(rng.uniform(f0, 0.85) * d, "kill", "trainer", required=True) for _ in range(p["trainer_kills"])]
    faults += [Fault(rng.uniform(f0, 0.55) * d, "kill", "feed", required=True) for _ in range(p["feed_kills"])]
    n_workers = p.get("worker_kills", 0)
    faults += [Fault(rng.uniform(f0, 0.9) * d, "kill", w, required=True) for w in WORKERS for _ in range(n_workers)]
    for _ in range(p["kills"] - p["trainer_kills"] - p["feed_kills"] - n_workers * len(WORKERS)):
        target = rng.choice(BASE_ROLES)
        faults.append(Fault(rng.uniform(f0, 0.55 if target == "feed" else 0.9) * d, "kill", target))
    if not p["broker_restarts"]:
        broker = []
    elif p.get("nodes", 1) > 1:
        broker = cluster_faults(p["nodes"], p["broker_restarts"] - 2, p["long_down_s"], rng)
    else:
        broker = [("", rng.uniform(10, 20)) for _ in range(p["broker_restarts"])]
    for i, (target, down_s) in enumerate(broker):  # one per segment, in its first half: never two at once
        seg = 0.8 * d / len(broker)
        faults.append(Fault(0.1 * d + i * seg + rng.uniform(0, 0.5) * seg, "broker", target, arg=down_s))
    for j in range(p["joins"]):
        seg = 0.85 * d / p["joins"]
        t = 0.05 * d + j * seg + rng.uniform(0, 0.2) * seg
        faults.append(Fault(t, "join", f"x{j}"))
        faults.append(Fault(t + rng.uniform(0.4, 0.7) * seg, "leave", f"x{j}"))
    bursts = max(1, min(p["fuzz"], max(5, p["fuzz"] // 20)))
    sizes = [p["fuzz"] // bursts + (1 if i < p["fuzz"] % bursts else 0) for i in range(bursts)]
    faults += [Fault(rng.uniform(0.02, 0.9) * d, "fuzz", arg=n) for n in sizes if n]
    return sorted(faults, key=lambda f: f.at)
