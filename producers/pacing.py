"""Paced dispatch (``feed.dispatch = "paced"``): the feed publishes a group only when a rollout
worker may start it and has room for it, and puts it where the queue is shortest.

* **Admission moved to the feed.** The feed follows rl.control and publishes group ``g`` only once
  ``may_admit(g, v, k + L, G, C(v))`` holds for the newest published version ``v``, where
  ``L = feed.paced_lead_steps``: the workers hold at most ``L`` steps of groups waiting for
  weights (and start them the moment the weights load), never a topic full of inadmissible work.
* **Join the shortest queue.** A partition's backlog is the number of the feed's own messages on
  it that the rollout group has not committed yet (queued, or being generated: a worker commits a
  prompt only once its trajectories are on the broker). Each message of a group goes to a distinct
  partition with the smallest backlog, and only while that backlog is below ``feed.paced_backlog``:
  work lands on the workers that are free, instead of piling up behind a busy one.

Backlogs come from the feed's delivery reports (offsets it wrote) and one committed-offsets request
per refresh; messages other producers write to the topic are not counted.

What this is not: a scheduler inside the workers (they still check admission, as the hard guard of
wasted work) nor a replacement for consumer-group balancing (partitions still belong to workers).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from pipeline.admin import Admin
from pipeline.control import ControlFollower, may_admit
from pipeline.kafka import client_conf
from pipeline.log import kv
from pipeline.topology import Topology

log = logging.getLogger(__name__)


class Pacer:
    def __init__(self, cfg, topic: str, partitions: int):
        self.cfg, self.topic, self.n_parts = cfg, topic, partitions
        self.k, self.G = cfg.rl.max_staleness, cfg.rl.groups_per_step
        self.lead = cfg.feed.paced_lead_steps
        """Steps of groups published ahead of admission (the workers hold them until admitted)."""
        self.group = Topology(cfg).group("rollout")
        """The rollout workers' consumer group, whose committed offsets say what they took."""
        self.target = cfg.feed.paced_backlog
        self.control = ControlFollower(cfg, "feed-pacer")
        self.admin = Admin(client_conf(cfg, "feed-pacer"), cfg.kafka.request_timeout_s)
        self.delivered: dict[int, set[int]] = defaultdict(set)  # partition -> own offsets not yet committed
        self.in_flight: dict[int, int] = defaultdict(int)  # partition -> produced, not yet acknowledged
        self.version = 0
        self._refreshed = 0.0

    def catch_up(self, timeout: float) -> None:
        upd = self.control.catch_up(timeout)
        self.version = upd["version"] if upd else 0
        self.refresh(force=True)

    def backlog(self, p: int) -> int:
        return len(self.delivered[p]) + self.in_flight[p]

    def refresh(self, force: bool = False) -> None:
        """Newest published version, and the rollout group's committed offsets (at most 10 per s)."""
        now = time.monotonic()
        if not force and now - self._refreshed < 0.1:
            return
        self._refreshed = now
        self.control.poll(0)
        self.control.commands.clear()
        if self.control.latest_update is not None:
            self.version = max(self.version, self.control.latest_update["version"])
        committed = self.admin.committed(self.group, self.topic, self.n_parts)
        for p, off in committed.items():
            if off >= 0 and self.delivered[p]:
                self.delivered[p] = {o for o in self.delivered[p] if o >= off}

    def admissible(self, g: int) -> bool:
        """Group ``g`` may go out: admissible at the newest version, ``lead`` steps ahead."""
        return may_admit(g, self.version, self.k + self.lead, self.G, self.control.consumed_groups(self.version))

    def place(self, g: int, n: int) -> list[int] | None:
        """Partitions for group ``g``'s ``n`` messages, or None while it may not go out. What the
        feed already knows is tried first: a refresh (a committed-offsets request to the broker,
        tens to hundreds of ms) only ever widens the choice, so it is paid only when needed, and
        groups go out back to back while there is room."""
        if self.admissible(g) and (parts := self.pick(n)) is not None:
            return parts
        self.refresh()
        return self.pick(n) if self.admissible(g) else None

    def pick(self, n: int) -> list[int] | None:
        """``n`` distinct partitions with the shortest backlogs, or None while the shortest is full."""
        order = sorted(range(self.n_parts), key=lambda p: (self.backlog(p), p))[:n]
        if self.backlog(order[0]) >= self.target:
            return None
        return order

    def sent(self, p: int) -> None:
        self.in_flight[p] += 1

    def on_delivery(self, err, msg) -> None:
        p = msg.partition()
        self.in_flight[p] = max(0, self.in_flight[p] - 1)
        if err is None:
            self.delivered[p].add(msg.offset())

    def status(self) -> str:
        return kv(version=self.version, backlog=[self.backlog(p) for p in range(self.n_parts)])

    def close(self) -> None:
        try:
            self.control.close()
        finally:
            self.admin.close()
