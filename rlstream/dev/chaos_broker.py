"""The broker faults of ``rlstream chaos``, run in a thread while the watch loop keeps supervising.

* ``BrokerOps``: one local broker, stopped by PID, down for a while, started again on its data dir
  and port (a graceful restart).
* ``ClusterOps``: a local cluster (``--nodes 3``): hard faults of one node at a time: ``kill`` (SIGKILL,
  down for a while, then restarted on its storage and ports: the partitions it led, and any group or
  transaction coordinator it was, move to the others and back), ``pause`` (SIGSTOP then SIGCONT: a
  node that holds its sockets and answers nothing), ``rolling`` (every node in turn stopped with
  SIGTERM and started, each back in the cluster before the next). Each record names what the node
  was when it was hit (leader of which partitions of the run's topics, coordinator of which groups).

The plan (``cluster_faults``) kills every node at least once, one of them for minutes
(``long_down_s``) while the others serve, and adds a pause and a rolling restart.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time

from pipeline.log import kv

log = logging.getLogger(__name__)


class BrokerOps:
    """Restarts of our local broker, in a thread (the watch loop keeps supervising meanwhile)."""

    def __init__(self, broker, say):
        self.broker, self.say = broker, say
        self.done: list[dict] = []
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def restart(self, down_s: float, t: float, target: str = "") -> None:
        """Start the fault ``target`` (one broker: always a restart) in the background."""
        self._thread = threading.Thread(target=self._run, args=(down_s, t, target), name="broker-fault", daemon=True)
        self._thread.start()

    def _run(self, down_s: float, t: float, target: str) -> None:
        rec = {"t": round(t, 1), "down_s": round(down_s, 1), "fault": target or "restart"}
        try:
            self._fault(rec, down_s, target)
            rec["ok"] = True
        except Exception as exc:  # reported; the audit then finds what the outage did
            rec["error"] = f"{type(exc).__name__}: {exc}"
            log.error("broker fault failed %s", kv(fault=rec["fault"], error=exc))
        self.done.append(rec)

    def _fault(self, rec: dict, down_s: float, target: str) -> None:
        t0 = time.monotonic()
        self.broker.stop(progress=self.say)
        rec["stop_s"] = round(time.monotonic() - t0, 1)
        time.sleep(down_s)
        t1 = time.monotonic()
        self.ensure_running()
        rec["start_s"] = round(time.monotonic() - t1, 1)

    def ensure_running(self) -> None:
        for attempt in range(3):
            try:
                self.broker.start(progress=self.say, owned=True)
                return
            except Exception as exc:
                if attempt == 2:
                    raise
                log.warning("broker start failed; retrying %s", kv(error=exc))
                time.sleep(5)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class ClusterOps(BrokerOps):
    """Hard faults of one node of a ``LocalCluster`` at a time (module docstring). ``topics`` and
    ``groups``: the run's, for the record of what a node was when it was hit."""

    def __init__(self, cluster, say, topics: list[str] = (), groups: list[str] = ()):
        super().__init__(cluster, say)
        self.topics, self.groups = list(topics), list(groups)

    def _fault(self, rec: dict, down_s: float, target: str) -> None:
        kind, _, node = target.partition(":")
        c = self.broker
        if kind == "rolling":
            t0 = time.monotonic()
            for n in range(1, c.nodes + 1):
                c.kill(n, signal.SIGTERM)
                c.start_node(n, progress=self.say)
            rec["rolling_s"] = round(time.monotonic() - t0, 1)
            return
        n = int(node)
        rec["node"], rec["was"] = n, self._roles_of(n)
        if kind == "pause":
            c.pause(n)
            self.say(f"node {n} paused (SIGSTOP) for {down_s:.0f} s; it was {rec['was'] or 'nothing of ours'}")
            try:
                time.sleep(down_s)
            finally:
                c.resume(n)
            return
        c.kill(n, signal.SIGKILL)
        self.say(f"node {n} killed (SIGKILL), down {down_s:.0f} s; it was {rec['was'] or 'nothing of ours'}")
        time.sleep(down_s)
        t1 = time.monotonic()
        c.start_node(n, progress=self.say)
        rec["start_s"] = round(time.monotonic() - t1, 1)

    def _roles_of(self, node: int) -> list[str]:
        """What ``node`` leads or coordinates among the run's topics and groups (best effort: a
        cluster in the middle of a move may not say)."""
        out = []
        try:
            for topic in self.topics:
                led = [p for p, leader in self.broker.leaders(topic).items() if leader == node]
                if led:
                    out.append(f"leader of {topic}{led}")
            out += [f"coordinator of {g}" for g in self.groups if self.broker.group_coordinator(g) == node]
        except Exception as exc:  # a record, not a fault
            out.append(f"(unknown: {type(exc).__name__})")
        return out

    def ensure_running(self) -> None:
        """Every node up (the audit reads the topics): start the ones that are down."""
        self.broker.revive(progress=self.say)


def cluster_faults(nodes: int, restarts: int, long_down_s: float, rng: random.Random) -> list[tuple[str, float]]:
    """The cluster's broker faults as (target, seconds down): every node killed at least once (the
    last kill for ``long_down_s``), a pause, a rolling restart; in a seeded order."""
    kills = [(f"kill:{i % nodes + 1}", rng.uniform(10, 20)) for i in range(max(restarts, nodes))]
    kills[-1] = (kills[-1][0], long_down_s)
    faults = [*kills, (f"pause:{rng.randint(1, nodes)}", rng.uniform(10, 20)), ("rolling", 0.0)]
    rng.shuffle(faults)
    return faults
