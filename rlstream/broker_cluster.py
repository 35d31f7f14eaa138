"""A local Kafka cluster of N KRaft nodes on one machine, for fault tests (``broker.nodes`` > 1,
``rlstream broker start --nodes 3``).

Every node is combined-mode (``process.roles=broker,controller``), ``node.id`` 1..N, all N in
``controller.quorum.voters``, run from the same jars as the one-node ``LocalBroker`` (whose
properties, format, spawn, watcher and kill code this shares: ``rlstream.broker``). The storage of
all nodes is formatted with one cluster id and ``transaction.version=2`` (KIP-890's server-side
transaction defence). Internal topics and new topics get min(3, N) replicas and
``min.insync.replicas`` min(2, N); unclean leader election is off.

Files in ``data_dir``: ``cluster.json`` (node count, cluster id and each node's ports: a restart
reuses them so clients reconnect), ``broker.json`` (the state while it runs: ``bootstrap`` lists
every node, ``nodes`` each node's pid and ports; top-level ``pid``/``port`` are node 1's) and per
node ``node-<i>/``: ``server.properties``, ``logs/``, ``broker.log``, ``kafka-server.log``.

For the chaos work: ``kill(node, sig)`` (SIGKILL: a hard fault), ``start_node(node)`` (restart one
node on its storage and ports), ``pause``/``resume`` (SIGSTOP/SIGCONT), and who leads a partition
or coordinates a group (``leader``, ``group_coordinator``). Not for production: one machine is one
fault domain. SASL_SSL is refused for now (``broker.security`` needs ``broker.nodes = 1``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from pipeline.errors import BrokerError, ConfigError
from pipeline.log import kv
from pipeline.ports import free_port, pid_alive, port_open
from rlstream.broker import (
    LocalBroker,
    RunningState,
    format_storage,
    java_command,
    kill_pids,
    metadata_brokers,
    new_cluster_id,
    read_broker_state,
    reap_watch,
    server_properties,
    spawn_broker,
    start_watch,
)
from rlstream.kafka_jars import classpath, java_version

log = logging.getLogger(__name__)
FORMAT_FEATURES = ["--feature", "transaction.version=2"]
"""Features pinned when the storage is formatted (Kafka 4.x defaults to them; pinned all the same)."""


class LocalCluster(RunningState):
    """Start, stop, inspect and break a local cluster of ``nodes`` KRaft nodes. ``cfg`` is a
    BrokerConfig (``nodes`` defaults to ``cfg.nodes``)."""

    def __init__(self, cfg, nodes: int | None = None):
        self.cfg = cfg
        self.nodes = nodes or cfg.nodes
        if not 1 < self.nodes <= 9:
            raise ConfigError(f"a local cluster has 2 to 9 nodes, not {self.nodes} (1: rlstream.broker.LocalBroker)")
        if cfg.security != "plaintext":
            raise ConfigError('broker.security = "sasl_ssl" works with broker.nodes = 1 only (for now)')
        self.data_dir = Path(cfg.data_dir).expanduser()
        self.statefile = self.data_dir / "broker.json"
        self.layoutfile = self.data_dir / "cluster.json"
        self._watches: dict[int, object] = {}
        """node -> the watcher that stops it if this process dies (``start(owned=True)``)."""
        self._owned = False

    secured = False

    def node_dir(self, node: int) -> Path:
        return self.data_dir / f"node-{node}"

    def logfile(self, node: int) -> Path:
        return self.node_dir(node) / "broker.log"

    # -- status ------------------------------------------------------------------------------
    def client_conf(self, user: str = "admin", password: str | None = None) -> dict[str, str]:
        return {}  # plaintext only

    def _recorded_state(self) -> dict | None:
        """The state file as written, whether or not node 1 (whose pid ``state`` checks) runs."""
        try:
            return json.loads(self.statefile.read_text())
        except (OSError, ValueError):
            return None

    def _node_state(self, node: int) -> dict:
        s = self._recorded_state()  # not ``state``: node 1 may be the one down
        if not s:
            raise BrokerError(f"no local cluster runs in {self.data_dir}")
        if not 1 <= node <= len(s["nodes"]):
            raise BrokerError(f"no node {node}: the cluster has nodes 1..{len(s['nodes'])}")
        return s["nodes"][node - 1]

    # -- properties --------------------------------------------------------------------------
    def properties(self, ports: dict[int, tuple[int, int]]) -> dict[int, str]:
        """node -> its server.properties text, for ``ports``: node -> (client, controller)."""
        host = self.cfg.host
        voters = ",".join(f"{i}@{host}:{c}" for i, (_, c) in sorted(ports.items()))
        out = {}
        for i, (port, cport) in ports.items():
            props = server_properties(host, i, port, cport, voters, self.node_dir(i) / "logs", self.nodes)
            props.update(self.cfg.properties)
            out[i] = "".join(f"{k}={v}\n" for k, v in props.items())
        return out

    def _layout(self) -> dict:
        try:
            layout = json.loads(self.layoutfile.read_text())
        except (OSError, ValueError):
            return {}
        if layout.get("nodes") != self.nodes:
            raise BrokerError(
                f"{self.data_dir} holds a cluster of {layout.get('nodes')} nodes, not {self.nodes}: start it with "
                f"--nodes {layout.get('nodes')}, or use another broker.data_dir"
            )
        return layout

    def _ports(self, layout: dict) -> dict[int, tuple[int, int]]:
        """Each node's (client, controller) port: the previous ones while all are free, else
        ``broker.port`` + i - 1 (0: free ones) and free controller ports."""
        host = self.cfg.host
        previous = {int(i): tuple(p) for i, p in layout.get("ports", {}).items()}
        if len(previous) == self.nodes and not any(port_open(host, p) for pair in previous.values() for p in pair):
            return previous
        taken: set[int] = set()

        def fresh() -> int:
            p = free_port(host, avoid=taken)
            taken.add(p)
            return p

        ports = {}
        for i in range(1, self.nodes + 1):
            port = self.cfg.port + i - 1 if self.cfg.port else fresh()
            taken.add(port)
            ports[i] = (port, fresh())
        return ports

    # -- start -------------------------------------------------------------------------------
    def start(self, progress=print, owned: bool = False) -> dict:
        """Start every node unless the cluster runs; return its state once every node answers
        metadata and names all N brokers. Nodes start concurrently (a KRaft quorum needs a
        majority up before any node is ready). ``owned``: as ``LocalBroker.start``, for every node."""
        running = self.state()
        if running:
            progress(f"cluster already running: {len(running['nodes'])} nodes at {running['bootstrap']}")
            return running
        recorded = self._recorded_state()
        if recorded and any(pid_alive(int(n["pid"])) for n in recorded.get("nodes", [])):
            self._owned = self._owned or owned  # node 1 is down, others run: start the ones down
            self.revive(progress)
            return self._recorded_state()
        java_version()
        cp = classpath(progress)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        layout = self._layout()
        ports = self._ports(layout)
        busy = [p for p, _ in ports.values() if port_open(self.cfg.host, p)]
        if busy:
            raise BrokerError(
                f"port(s) {busy} on {self.cfg.host} already in use; set broker.port to another first port "
                "or 0 to pick free ones"
            )
        cluster_id = layout.get("cluster_id") or new_cluster_id()
        self.layoutfile.write_text(
            json.dumps({"nodes": self.nodes, "cluster_id": cluster_id, "ports": ports}, indent=2)
        )
        javas, formats = {}, {}
        for i, text in self.properties(ports).items():
            self.node_dir(i).mkdir(exist_ok=True)
            (self.node_dir(i) / "server.properties").write_text(text)
            javas[i] = java_command(cp, self.node_dir(i))
            if not (self.node_dir(i) / "logs" / "meta.properties").is_file():
                progress(f"formatting storage of node {i} in {self.node_dir(i) / 'logs'}")
                formats[i] = format_storage(
                    javas[i], cluster_id, self.node_dir(i) / "server.properties", FORMAT_FEATURES
                )
        for i, fmt in formats.items():  # all run at once
            out, _ = fmt.communicate()
            if fmt.returncode != 0:
                raise BrokerError(f"formatting the storage of node {i} failed:\n{out[-2000:]}")
        self._owned = owned
        procs = {}
        for i in ports:
            procs[i] = spawn_broker(javas[i], self.cfg, self.node_dir(i) / "server.properties", self.logfile(i))
            if owned:
                self._watches[i] = start_watch(procs[i].pid, self.logfile(i))
        state = {
            "pid": procs[1].pid,
            "port": ports[1][0],
            "controller_port": ports[1][1],
            "bootstrap": ",".join(f"{self.cfg.host}:{p}" for p, _ in ports.values()),
            "data_dir": str(self.data_dir),
            "started_at": time.time(),
            "security": self.cfg.security,
            "cluster_id": cluster_id,
            "nodes": [
                {"node": i, "pid": procs[i].pid, "port": p, "controller_port": c, "data_dir": str(self.node_dir(i))}
                for i, (p, c) in ports.items()
            ],
        }
        self.statefile.write_text(json.dumps(state, indent=2))  # now: stop works during the wait
        try:
            self._wait_ready(procs, ports, time.monotonic() + self.cfg.start_timeout_s)
        except BaseException:
            self.stop(progress=lambda m: None)
            raise
        state["start_s"] = round(time.monotonic() - t0, 2)
        log.info("cluster started %s", kv(nodes=self.nodes, bootstrap=state["bootstrap"], start_s=state["start_s"]))
        progress(f"cluster running: {self.nodes} nodes at {state['bootstrap']} (started in {state['start_s']}s)")
        return state

    def _wait_ready(self, procs: dict, ports: dict[int, tuple[int, int]], deadline: float) -> None:
        """Until every node of ``procs`` reports all N brokers; BrokerError naming the node that
        exited or is not ready by ``deadline``."""
        waiting = set(procs)
        while waiting:
            for i in sorted(waiting):
                if procs[i].poll() is not None:
                    raise BrokerError(
                        f"node {i} exited with code {procs[i].returncode} during start; see {self.logfile(i)}:\n"
                        f"{self.tail(30, [i])}"
                    )
                if metadata_brokers(self.cfg.host, ports[i][0], {}) >= self.nodes:
                    waiting.discard(i)
            if waiting and time.monotonic() > deadline:
                logs = ", ".join(str(self.node_dir(i) / "kafka-server.log") for i in sorted(waiting))
                raise BrokerError(
                    f"node(s) {sorted(waiting)} did not report all {self.nodes} brokers within "
                    f"{self.cfg.start_timeout_s}s; see {logs}"
                )
            time.sleep(0.2)

    # -- one node (fault tests) -------------------------------------------------------------
    def pid(self, node: int) -> int:
        return int(self._node_state(node)["pid"])

    def kill(self, node: int, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Send ``sig`` to ``node`` (SIGKILL: a hard fault; SIGTERM: a clean stop). For either,
        return once it is gone."""
        pid = self.pid(node)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if sig in (signal.SIGKILL, signal.SIGTERM):
            kill_pids([pid], timeout)  # waits; SIGKILL after ``timeout``
            reap_watch(self._watches.pop(node, None))
        log.info("node signalled %s", kv(node=node, pid=pid, signal=signal.Signals(sig).name))

    def pause(self, node: int) -> None:
        """Freeze ``node`` (SIGSTOP): a broker that holds its sockets and answers nothing."""
        os.kill(self.pid(node), signal.SIGSTOP)

    def resume(self, node: int) -> None:
        os.kill(self.pid(node), signal.SIGCONT)

    def start_node(self, node: int, progress=print) -> int:
        """Restart ``node`` on its storage and ports (a no-op if it runs); return its pid once it
        reports every broker of the cluster."""
        ns = self._node_state(node)
        if pid_alive(int(ns["pid"])):
            return int(ns["pid"])
        reap_watch(self._watches.pop(node, None))
        java = java_command(classpath(progress), self.node_dir(node))
        proc = spawn_broker(java, self.cfg, self.node_dir(node) / "server.properties", self.logfile(node))
        if self._owned:
            self._watches[node] = start_watch(proc.pid, self.logfile(node))
        state = self._recorded_state()
        state["nodes"][node - 1]["pid"] = proc.pid
        if node == 1:
            state["pid"] = proc.pid
        self.statefile.write_text(json.dumps(state, indent=2))
        self._wait_ready(
            {node: proc}, {node: (ns["port"], ns["controller_port"])}, time.monotonic() + self.cfg.start_timeout_s
        )
        progress(f"node {node} running again: pid {proc.pid}")
        return proc.pid

    def _admin(self):
        from pipeline.admin import Admin

        return Admin({"bootstrap.servers": self.bootstrap}, timeout=30)

    def leader(self, topic: str, partition: int = 0) -> int:
        """The node that leads ``partition`` of ``topic`` (-1 while none does)."""
        return self._admin().partition_leaders(topic)[partition]

    def leaders(self, topic: str) -> dict[int, int]:
        """partition -> the node that leads it (-1 while none does)."""
        return self._admin().partition_leaders(topic)

    def group_coordinator(self, group: str) -> int:
        """The node that coordinates consumer group ``group``."""
        return self._admin().group_coordinator(group)

    def revive(self, progress=print) -> list[int]:
        """Start every node that is down (after faults); returns those started."""
        s = self._recorded_state()
        if not s:
            self.start(progress=progress, owned=self._owned)
            return list(range(1, self.nodes + 1))
        down = [n["node"] for n in s["nodes"] if not pid_alive(int(n["pid"]))]
        for node in down:
            self.start_node(node, progress=progress)
        return down

    # -- stop --------------------------------------------------------------------------------
    def stop(self, timeout: float = 30.0, progress=print) -> bool:
        """Stop every node by its recorded PID, all at once. False if none was running."""
        try:
            state = json.loads(self.statefile.read_text())
        except (OSError, ValueError):
            progress("cluster not running (no state file)")
            return False
        pids = [int(n["pid"]) for n in state.get("nodes", [])]
        alive = [p for p in pids if pid_alive(p)]
        kill_pids(alive, timeout)
        for node in list(self._watches):
            reap_watch(self._watches.pop(node))
        self.statefile.unlink(missing_ok=True)
        progress(f"cluster stopped (pids {alive})" if alive else "cluster not running (stale pids)")
        return bool(alive)

    def tail(self, lines: int = 50, nodes: list[int] | None = None) -> str:
        text = ""
        for i in nodes or range(1, self.nodes + 1):
            text += f"==> node {i} <==\n"
            for f in (self.logfile(i), self.node_dir(i) / "kafka-server.log"):
                if f.is_file():
                    text += "".join(f.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        return text


def local_broker(cfg, nodes: int | None = None) -> LocalBroker | LocalCluster:
    """The local broker of BrokerConfig ``cfg``: a LocalBroker, or with ``nodes`` (default
    ``broker.nodes``) above 1, or a cluster already running in ``data_dir``, a LocalCluster."""
    running = read_broker_state(Path(cfg.data_dir).expanduser())
    n = len(running["nodes"]) if running and "nodes" in running else (nodes or cfg.nodes)
    return LocalCluster(cfg, n) if n > 1 else LocalBroker(cfg)
