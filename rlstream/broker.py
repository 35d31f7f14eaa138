"""The local Apache Kafka broker for machines without Docker.

A real Kafka 4.x broker in KRaft combined mode (broker + controller, one node) on 127.0.0.1,
run from jars that Maven resolves from Maven Central (``infra/kafka/pom.xml``; cached in
``~/.m2``, never committed). The first start downloads; later starts reuse a cached classpath.

Files in ``data_dir``: ``server.properties``, ``logs/`` (Kafka's data), ``broker.log``,
``broker.pid`` and ``broker.json`` (pid, ports, bootstrap, security). Stop is by that PID only.

``broker.security = "sasl_ssl"`` (docs/how-to/security.md) starts it secured: the client listener is
SASL_SSL with SCRAM-SHA-512 users from ``broker.users`` (created when the storage is formatted, and
brought in line at every start), TLS with a certificate signed by a CA generated at the first
start (``data_dir/tls``; ``tls/ca.pem`` is what clients give as ``ssl.ca.location``), and
StandardAuthorizer with nothing allowed without an ACL (``admin`` is the super user). Inter-broker
traffic uses the same listener as ``admin``; the controller listener stays on ``host`` with
SASL/PLAIN for ``admin`` only (a PLAINTEXT one would make the anonymous principal a super user).

This is for development, tests and the demo. Production clusters are run by Kafka's own tooling.
Several nodes (``broker.nodes`` > 1, for fault tests): ``rlstream.broker_cluster``, which shares the
properties, format, spawn, watcher and kill functions at the end of this module.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pipeline.errors import BrokerError
from pipeline.log import kv
from pipeline.ports import free_port, pid_alive, port_open
from rlstream.broker_security import SCRAM_MECHANISM, BrokerSecurity
from rlstream.kafka_jars import classpath, java_version

log = logging.getLogger(__name__)
WATCH_GRACE_S = 30
"""How long the watcher of an owned broker waits after SIGTERM before SIGKILL."""
LOG4J2 = """status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def read_broker_state(data_dir: Path) -> dict | None:
    """The running broker's state file, or None if it is absent or its process is gone (for a
    cluster, ``rlstream.broker_cluster``: every node's process)."""
    f = Path(data_dir) / "broker.json"
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    pids = [int(n.get("pid", -1)) for n in state.get("nodes", [])] or [int(state.get("pid", -1))]
    return state if any(map(pid_alive, pids)) else None


class RunningState:
    """What a local broker or cluster in ``self.data_dir`` says of itself while it runs."""

    data_dir: Path

    def state(self) -> dict | None:
        return read_broker_state(self.data_dir)

    @property
    def bootstrap(self) -> str | None:
        s = self.state()
        return s["bootstrap"] if s else None


class LocalBroker(RunningState, BrokerSecurity):
    """Start, stop and inspect one local KRaft broker. ``cfg`` is a BrokerConfig."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.data_dir = Path(cfg.data_dir).expanduser()
        self.pidfile = self.data_dir / "broker.pid"
        self.statefile = self.data_dir / "broker.json"
        self.logfile = self.data_dir / "broker.log"
        self.tls_dir = self.data_dir / "tls"
        self.ca_file = self.tls_dir / "ca.pem"
        """The CA that signed the broker's certificate (``ssl.ca.location`` of its clients)."""
        self.formatfile = self.data_dir / "security.json"
        """The security mode (and SCRAM users) the storage was formatted with."""
        self._watch: subprocess.Popen | None = None
        """The watcher that stops the broker if this process dies (``start(owned=True)``)."""
        self.advertised_port: int | None = None
        """Set before ``start``: clients are told the broker is at this port of ``host`` (a proxy in
        front of it, ``rlstream.dev.faultproxy``), and its bootstrap is that address; the broker's
        own traffic to itself uses a plaintext listener of its own."""

    @property
    def secured(self) -> bool:
        return self.cfg.security == "sasl_ssl"

    # -- status ------------------------------------------------------------------------------
    def client_conf(self, user: str = "admin", password: str | None = None) -> dict[str, str]:
        """librdkafka settings (for ``kafka.common``) of a client of this broker that is ``user``
        (password from ``broker.users`` unless given). Empty for a ``plaintext`` broker."""
        if not self.secured:
            return {}
        if password is None and user not in self.cfg.users:
            raise BrokerError(f"no password for user {user!r}: not in broker.users")
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": SCRAM_MECHANISM,
            "sasl.username": user,
            "sasl.password": password if password is not None else self.cfg.users[user],
            "ssl.ca.location": str(self.ca_file),
        }

    # -- start -------------------------------------------------------------------------------
    def _properties(self, port: int, controller_port: int) -> str:
        listener = "SASL_SSL" if self.secured else "PLAINTEXT"
        host = self.cfg.host
        props = server_properties(
            host, 1, port, controller_port, f"1@{host}:{controller_port}", self.data_dir / "logs", 1, listener
        )
        if self.secured:
            props.update(self._security_properties())
        if self.advertised_port:
            internal = free_port(host, avoid=(port, controller_port))
            props["listeners"] += f",INTERNAL://{host}:{internal}"
            props["advertised.listeners"] = f"{listener}://{host}:{self.advertised_port},INTERNAL://{host}:{internal}"
            props["inter.broker.listener.name"] = "INTERNAL"
            props["listener.security.protocol.map"] += ",INTERNAL:PLAINTEXT"
        props.update(self.cfg.properties)
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def start(self, progress=print, owned: bool = False) -> dict:
        """Start the broker unless it already runs; return its state. Idempotent. ``owned``: this
        process started it for itself, so it must not outlive this process, even one killed with
        ``kill -9`` (``rlstream.broker_watch``); ``rlstream broker start`` leaves it running."""
        running = self.state()
        if running:
            progress(f"broker already running: pid {running['pid']} at {running['bootstrap']}")
            return running
        java_version()
        cp = classpath(progress)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        formatted = (self.data_dir / "logs" / "meta.properties").is_file()
        if formatted:
            self._check_format()
        port = self.cfg.port or self._previous_port() or free_port(self.cfg.host)
        if port_open(self.cfg.host, port):
            raise BrokerError(
                f"port {port} on {self.cfg.host} is already in use; set broker.port to another port "
                "or 0 to pick a free one (or point kafka.bootstrap_servers at that broker)"
            )
        controller_port = free_port(self.cfg.host, avoid=(port,))
        if self.secured:
            self._ensure_tls(progress)
        props_file = self.data_dir / "server.properties"
        props_file.touch(mode=0o600)  # holds passwords when secured
        props_file.write_text(self._properties(port, controller_port))
        java = java_command(cp, self.data_dir)
        if not formatted:
            progress(f"formatting storage in {self.data_dir / 'logs'}")
            self._write_format_record()  # first: a format cut short is redone at the next start
            fmt = format_storage(java, new_cluster_id(), props_file, self._scram_args() if self.secured else [])
            out, _ = fmt.communicate()
            if fmt.returncode != 0:
                raise BrokerError(f"formatting Kafka storage failed:\n{out[-2000:]}")
        proc = spawn_broker(java, self.cfg, props_file, self.logfile)
        self.pidfile.write_text(str(proc.pid))
        if owned:
            self._watch = start_watch(proc.pid, self.logfile)
        state = {
            "pid": proc.pid,
            "port": port,
            "controller_port": controller_port,
            "bootstrap": f"{self.cfg.host}:{self.advertised_port or port}",
            "data_dir": str(self.data_dir),
            "started_at": time.time(),
            "security": self.cfg.security,
        }
        if self.secured:
            state.update(
                security_protocol="SASL_SSL",
                sasl_mechanism=SCRAM_MECHANISM,
                ca_location=str(self.ca_file),
                users=sorted(self.cfg.users),
                admin_properties=str(self._write_admin_properties()),
            )
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not self._ready(port):
            if proc.poll() is not None:
                self.pidfile.unlink(missing_ok=True)
                self._reap_watch()
                raise BrokerError(
                    f"broker exited with code {proc.returncode} during start; see {self.logfile}:\n{self.tail(30)}"
                )
            if time.monotonic() > deadline:
                self._kill(proc.pid)
                self._reap_watch()
                raise BrokerError(
                    f"broker did not accept connections within {self.cfg.start_timeout_s}s; see {self.logfile}"
                )
            time.sleep(0.2)
        if self.secured and formatted:  # a fresh format already holds every user
            self._sync_users(port, proc.pid)
        self.statefile.write_text(json.dumps(state, indent=2))
        (self.data_dir / "last-port").write_text(str(port))
        state["start_s"] = round(time.monotonic() - t0, 2)
        log.info(
            "broker started %s",
            kv(pid=proc.pid, bootstrap=state["bootstrap"], security=self.cfg.security, start_s=state["start_s"]),
        )
        secured = f", SASL_SSL/{SCRAM_MECHANISM}, CA {self.ca_file}" if self.secured else ""
        progress(f"broker running: pid {proc.pid} at {state['bootstrap']}{secured} (started in {state['start_s']}s)")
        return state

    def _reap_watch(self, timeout: float = 10.0) -> None:
        reap_watch(self._watch, timeout)
        self._watch = None

    def _previous_port(self) -> int | None:
        """With broker.port = 0, a restart reuses the last port if free, so clients reconnect."""
        try:
            port = int((self.data_dir / "last-port").read_text())
        except (OSError, ValueError):
            return None
        return None if port_open(self.cfg.host, port) else port

    def _ready(self, port: int) -> bool:
        """The broker answers a metadata request (as admin over SASL_SSL when secured)."""
        return metadata_brokers(self.cfg.host, port, self.client_conf("admin")) > 0

    # -- stop --------------------------------------------------------------------------------
    def stop(self, timeout: float = 30.0, progress=print) -> bool:
        """Stop the broker by its recorded PID. Returns False if none was running."""
        try:
            pid = int(self.pidfile.read_text())
        except (OSError, ValueError):
            progress("broker not running (no pidfile)")
            return False
        if not pid_alive(pid):
            progress(f"broker not running (stale pid {pid})")
            self._reap_watch()
            self._cleanup()
            return False
        self._kill(pid, timeout)
        self._reap_watch()
        self._cleanup()
        progress(f"broker stopped (pid {pid})")
        return True

    def _kill(self, pid: int, timeout: float = 30.0) -> None:
        kill_pids([pid], timeout)

    def _cleanup(self) -> None:
        self.pidfile.unlink(missing_ok=True)
        self.statefile.unlink(missing_ok=True)

    def tail(self, lines: int = 50) -> str:
        text = ""
        for f in (self.logfile, self.data_dir / "kafka-server.log"):
            if f.is_file():
                text += "".join(f.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        return text


def server_properties(
    host: str,
    node_id: int,
    port: int,
    controller_port: int,
    voters: str,
    log_dir: Path,
    nodes: int,
    listener: str = "PLAINTEXT",
) -> dict[str, str]:
    """The built-in server.properties of KRaft combined-mode node ``node_id`` of a cluster of
    ``nodes`` (``voters``: ``controller.quorum.voters``). Replication of the internal topics and
    the defaults of new topics: min(3, nodes) replicas, min.insync.replicas min(2, nodes)."""
    rf, isr = str(min(3, nodes)), str(min(2, nodes))
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "listeners": f"{listener}://{host}:{port},CONTROLLER://{host}:{controller_port}",
        "advertised.listeners": f"{listener}://{host}:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": listener,
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": "1",
        "default.replication.factor": rf,
        "min.insync.replicas": isr,
        "offsets.topic.replication.factor": rf,
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": isr,
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": isr,
        # a new classic group waits this long for more members before its first assignment (and as
        # long again after each member that joined in the wait): roles started together then form it
        # in one round instead of a rebalance after the first steps (~3 s with the reward workers'
        # heartbeat: docs/results/performance.md, "Rebalance pauses"). ``rlstream run`` forks the members of
        # a group from one fork server within milliseconds of each other, and the reward workers
        # seconds before the first rollout (rlstream.forkserver.FIRST_COMMANDS); the rollout group's
        # two windows (~1 s) come before the first step. 1000 (two windows: 2 s before the first
        # step) until the staged fork server; 500 missed a reward worker by 0.68 s in 1 of 10 runs
        # before it, when that group still formed on the first step's path. Kafka's default is 3000.
        "group.initial.rebalance.delay.ms": "500",
        # groups on the KIP-848 protocol (kafka.consumer group.protocol=consumer): members learn of a
        # new assignment within a heartbeat, and meanwhile a member's transactional offset commit waits
        # for its new epoch; 5 s (Kafka's default) paused the pipeline up to 4.8 s when a reward worker
        # joined, 500 ms under 1 s (docs/results/performance.md, "Rebalance pauses"). Classic groups ignore these.
        "group.consumer.heartbeat.interval.ms": "500",
        "group.consumer.min.heartbeat.interval.ms": "500",
        "message.max.bytes": str(16 * 1024 * 1024),
        "replica.fetch.max.bytes": str(16 * 1024 * 1024),
        "num.network.threads": "2",
        "num.io.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        "log.segment.bytes": str(256 * 1024 * 1024),
        "auto.create.topics.enable": "false",
        "delete.topic.enable": "true",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "5000",
        "transaction.remove.expired.transaction.cleanup.interval.ms": "60000",
    }
    if nodes > 1:
        props["unclean.leader.election.enable"] = "false"
    return props


def new_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def java_command(cp: str, node_dir: Path) -> list[str]:
    """``java`` with the classpath and a log4j2 config that logs to ``node_dir/kafka-server.log``."""
    log4j = node_dir / "log4j2.properties"
    log4j.write_text(LOG4J2.format(log=node_dir / "kafka-server.log"))
    return [shutil.which("java"), f"-Dlog4j2.configurationFile={log4j}", "-cp", cp]


def format_storage(java: list[str], cluster_id: str, props_file: Path, extra: list[str]) -> subprocess.Popen:
    """Start formatting the storage of ``props_file`` (wait with ``communicate()``: text output)."""
    return subprocess.Popen(
        [*java, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(props_file), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def spawn_broker(java: list[str], cfg, props_file: Path, logfile: Path) -> subprocess.Popen:
    """Start a Kafka JVM on ``props_file`` in its own session, its output appended to ``logfile``.
    ``cfg`` is the BrokerConfig (heap and java options)."""
    jvm = [
        f"-Xms{min(256, cfg.heap_mb)}m",
        f"-Xmx{cfg.heap_mb}m",
        *cfg.jvm_options,
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
    ]
    with open(logfile, "ab") as out:
        return subprocess.Popen(
            [java[0], *jvm, *java[1:], "kafka.Kafka", str(props_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # not killed by the terminal's Ctrl-C; stopped by PID
        )


def metadata_brokers(host: str, port: int, conf: dict[str, str]) -> int:
    """How many brokers the node at ``host:port`` reports in a metadata answer; 0 if it does not
    answer (yet)."""
    if not port_open(host, port, timeout=0.2):
        return 0
    from pipeline.admin import Admin

    try:
        return Admin({"bootstrap.servers": f"{host}:{port}", **conf}, timeout=2).broker_count()
    except Exception:  # not ready yet
        return 0


def start_watch(pid: int, logfile: Path) -> subprocess.Popen | None:
    """A process that stops broker ``pid`` once this one is gone (``rlstream.broker_watch``):
    it waits on pidfds of both, opened here, so no reused PID can mislead it."""
    if not hasattr(os, "pidfd_open"):
        log.warning("no pidfd_open here: this broker would outlive a killed owner %s", kv(pid=pid))
        return None
    fds = (os.pidfd_open(os.getpid()), os.pidfd_open(pid))
    try:
        with open(logfile, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "rlstream.broker_watch", *map(str, fds), str(WATCH_GRACE_S)],
                pass_fds=fds,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
    finally:
        for fd in fds:
            os.close(fd)


def reap_watch(watch: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """The broker is gone, so its watcher exits: collect it (no zombie in a long-lived owner)."""
    if watch is not None:
        try:
            watch.wait(timeout)
        except subprocess.TimeoutExpired:  # should not happen: it exits with the broker
            log.warning("broker watcher still running; killing it %s", kv(pid=watch.pid))
            watch.kill()
            watch.wait()


def kill_pids(pids: list[int], timeout: float = 30.0) -> None:
    """SIGTERM every process of ``pids`` at once (SIGCONT first: a paused one could not stop),
    SIGKILL those still running after ``timeout``; reap our own children."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        for pid in pids:
            _reap(pid)
        time.sleep(0.1)
    for pid in filter(pid_alive, pids):
        log.warning("broker did not stop on SIGTERM; sending SIGKILL %s", kv(pid=pid))
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            _reap(pid)
            time.sleep(0.05)
    for pid in pids:
        _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
