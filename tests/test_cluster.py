"""The local three-node KRaft cluster (``rlstream.broker_cluster``): the properties it generates
for N nodes (no JVM), and a real cluster that loses the leader of a partition to SIGKILL while a
transactional producer and a read_committed consumer go on (acks=all, min.insync.replicas=2 with
two nodes in sync), then gets it back: nothing lost, nothing duplicated."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.admin import Admin, topic_configs
from pipeline.errors import ConfigError, KafkaClientError, TopicError
from pipeline.kafka import Consumer, Producer, client_conf
from pipeline.kafka.common import wait_for
from rlstream.broker import LocalBroker
from rlstream.broker_cluster import LocalCluster, local_broker
from rlstream.config import BrokerConfig, load_config


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def test_properties_of_n_nodes(tmp_path):
    ports = {1: (9001, 9101), 2: (9002, 9102), 3: (9003, 9103)}
    cluster = LocalCluster(BrokerConfig(data_dir=tmp_path, nodes=3, properties={"num.io.threads": "2"}))
    props = {i: _props(t) for i, t in cluster.properties(ports).items()}
    voters = "1@127.0.0.1:9101,2@127.0.0.1:9102,3@127.0.0.1:9103"
    for i, p in props.items():
        assert p["node.id"] == str(i) and p["process.roles"] == "broker,controller"
        assert p["controller.quorum.voters"] == voters
        assert p["listeners"] == f"PLAINTEXT://127.0.0.1:{ports[i][0]},CONTROLLER://127.0.0.1:{ports[i][1]}"
        assert p["log.dirs"] == str(tmp_path / f"node-{i}" / "logs")
        for key in ("default.replication.factor", "offsets.topic.replication.factor"):
            assert p[key] == "3"
        for key in ("transaction.state.log.replication.factor", "share.coordinator.state.topic.replication.factor"):
            assert p[key] == "3"
        for key in ("min.insync.replicas", "transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr"):
            assert p[key] == "2"
        assert p["unclean.leader.election.enable"] == "false"
        assert p["num.io.threads"] == "2"  # broker.properties wins
    two = _props(LocalCluster(BrokerConfig(data_dir=tmp_path, nodes=2)).properties({1: (1, 2), 2: (3, 4)})[1])
    assert two["default.replication.factor"] == "2" and two["min.insync.replicas"] == "2"
    # one node: the layout and properties of before (replication 1, no unclean-election key)
    one = _props(LocalBroker(BrokerConfig(data_dir=tmp_path))._properties(9092, 9093))
    assert one["controller.quorum.voters"] == "1@127.0.0.1:9093" and one["log.dirs"] == str(tmp_path / "logs")
    assert one["min.insync.replicas"] == "1" and "unclean.leader.election.enable" not in one
    assert isinstance(local_broker(BrokerConfig(data_dir=tmp_path)), LocalBroker)
    assert isinstance(local_broker(BrokerConfig(data_dir=tmp_path), nodes=3), LocalCluster)


def test_cluster_keys(tmp_path):
    with pytest.raises(ValueError, match="nodes = 1"):
        BrokerConfig(nodes=3, security="sasl_ssl", users={"admin": "admin-secret"})
    with pytest.raises(ConfigError, match="nodes"):
        load_config(None, ["broker.nodes=10"], environ={})
    with pytest.raises(ConfigError, match="min_insync_replicas"):
        load_config(None, ["topics.replication_factor=1", "topics.min_insync_replicas=2"], environ={})
    # unset, the replication is the cluster's: the in-sync count is checked against it before any
    # topic is created (pipeline.admin.replication), not when the config loads
    assert load_config(None, ["topics.min_insync_replicas=2"], environ={}).topics.replication_factor is None
    cfg = load_config(None, ["topics.replication_factor=3", "topics.min_insync_replicas=2"], environ={})
    assert topic_configs(cfg.topics.prompts, cfg.topics.min_insync_replicas)["min.insync.replicas"] == "2"
    assert "min.insync.replicas" not in topic_configs(cfg.topics.prompts)


BATCH = 20


def _produce(producer: Producer, topic: str, first: int, batches: int) -> None:
    """``batches`` transactions of BATCH records (values first, first+1, ...); a transaction that
    fails abortably is aborted and sent again (its records are then invisible to read_committed)."""
    for b in range(batches):
        values = range(first + b * BATCH, first + (b + 1) * BATCH)
        for attempt in range(10):
            producer.begin_transaction()
            try:
                for v in values:
                    producer.produce(topic, str(v).encode(), key=str(v).encode())
                producer.commit_transaction(120)
                break
            except KafkaClientError as exc:
                err = exc.args[1] if len(exc.args) > 1 else None
                if err is None or not (err.txn_requires_abort() or err.retriable()) or attempt == 9:
                    raise
                producer.abort_transaction(120)


def _consume(consumer: Consumer, want: int, seen: list[int], timeout: float = 240.0) -> None:
    """Read until ``seen`` holds ``want`` values, committing after every read."""
    deadline = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < deadline:
        msgs = consumer.consume(100, 1.0)
        if msgs:
            seen += [int(m.value()) for m in msgs]
            consumer.commit()
    assert len(seen) >= want, f"read {len(seen)} of {want} within {timeout}s"


def _proc_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (``T``: stopped by SIGSTOP)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _features(bootstrap: str) -> str:
    from rlstream.kafka_tools import kafka_tool_argv

    argv = kafka_tool_argv("features", ["--bootstrap-server", bootstrap, "describe"])
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=True).stdout


@pytest.mark.kafka
@pytest.mark.slow
def test_three_nodes_survive_a_killed_leader(tmp_path):
    cluster = LocalCluster(
        BrokerConfig(port=0, data_dir=tmp_path / "cluster", heap_mb=384, nodes=3, start_timeout_s=300)
    )
    producer = consumer = None
    try:
        state = cluster.start(progress=print, owned=True)
        assert len(state["nodes"]) == 3 and len(state["bootstrap"].split(",")) == 3
        feature = [line for line in _features(state["bootstrap"]).splitlines() if "transaction.version" in line]
        assert feature and "FinalizedVersionLevel: 2" in feature[0], feature
        cfg = load_config(
            None,
            [
                f"kafka.bootstrap_servers={state['bootstrap']}",
                "topics.prefix=cluster.",
                "topics.replication_factor=3",
                "topics.min_insync_replicas=2",
                "topics.prompts.partitions=3",
            ],
            environ={},
        )
        from pipeline.admin import ensure_topics

        ensure_topics(cfg, ["prompts"])
        topic = cfg.topics.name("prompts")
        admin = Admin(client_conf(cfg, "admin"))
        info = admin.describe([topic])[topic]
        assert info.replication_factor == 3 and info.configs["min.insync.replicas"] == "2"
        # unset, a topic takes the cluster's replication: 3 nodes -> 3 replicas, 2 in sync
        plain = load_config(None, [f"kafka.bootstrap_servers={state['bootstrap']}", "topics.prefix=plain."], environ={})
        ensure_topics(plain, ["dlq"])
        name, deadline = plain.topics.name("dlq"), time.monotonic() + 120
        while True:  # this client may ask a node that has not yet seen the new topic's metadata
            try:
                dflt = admin.describe([name])[name]
                break
            except TopicError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert dflt.replication_factor == 3 and dflt.configs["min.insync.replicas"] == "2"

        producer = Producer(client_conf(cfg, "test", kind="producer"), transactional_id="cluster-test")
        producer.init_transactions(120)
        consumer = Consumer(
            {**client_conf(cfg, "test", kind="consumer"), "isolation.level": "read_committed"}, group_id="cluster-g"
        )
        consumer.subscribe([topic])
        seen: list[int] = []
        _produce(producer, topic, 0, 5)
        _consume(consumer, 5 * BATCH, seen)

        victim = cluster.leader(topic, 0)
        print(
            f"killing node {victim}, leader of {topic}[0]; group coordinator: {cluster.group_coordinator('cluster-g')}"
        )
        cluster.kill(victim, signal.SIGKILL)
        _produce(producer, topic, 5 * BATCH, 5)  # acks=all with the two nodes left in sync
        _consume(consumer, 10 * BATCH, seen)
        assert wait_for(lambda: cluster.leader(topic, 0) not in (victim, -1), 120)

        cluster.start_node(victim, progress=print)
        assert wait_for(lambda: all(len(r) == 3 for r in admin.in_sync_replicas(topic).values()), 240, 0.5), (
            admin.in_sync_replicas(topic)
        )
        other = next(i for i in (1, 2, 3) if i != victim)
        cluster.pause(other)
        assert wait_for(lambda: _proc_state(cluster.pid(other)) == "T", 30)
        cluster.resume(other)
        assert wait_for(lambda: _proc_state(cluster.pid(other)) != "T", 30)
        _produce(producer, topic, 10 * BATCH, 2)
        _consume(consumer, 12 * BATCH, seen)

        assert sorted(seen) == list(range(12 * BATCH)), "the group read a record twice or missed one"
        with Consumer({**client_conf(cfg, "test", kind="consumer"), "isolation.level": "read_committed"}) as c:
            log = sorted(int(m.value()) for m in c.read_to_end(topic, timeout=120))
        assert log == list(range(12 * BATCH)), "the topic lost or duplicated a committed record"
        admin.close()
    finally:
        for client in (consumer, producer):
            if client is not None:
                try:
                    client.close()
                except Exception as exc:  # the cluster's state is what the test reports
                    print(f"closing {client}: {exc}")
        cluster.stop(progress=print)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_pipeline_runs_on_three_nodes_through_a_killed_node(tmp_path):
    """The whole pipeline (feed, rollout, reward, trainer as threads: tests/rl_pipeline.py) on
    rf 3 / min.isr 2 topics of a 3-node cluster; node 2 is SIGKILLed once the trainer's first
    step is logged (most steps then run on two nodes) and restarted once the third is (on a fast
    run, after the last); every step is made."""
    import threading

    from consumers.trainer.state import read_steps_log
    from pipeline.admin import ensure_topics
    from tests import rl_pipeline

    cluster = LocalCluster(
        BrokerConfig(port=0, data_dir=tmp_path / "cluster", heap_mb=384, nodes=3, start_timeout_s=300)
    )
    steps, faults, abort = 6, [], threading.Event()
    t = None
    try:
        state = cluster.start(progress=print, owned=True)
        task = rl_pipeline.write_task(tmp_path / "task.jsonl")
        cfg = load_config(
            None,
            [
                f"kafka.bootstrap_servers={state['bootstrap']}",
                "topics.prefix=pipe.",
                "topics.replication_factor=3",
                "topics.min_insync_replicas=2",
                f"run_dir={tmp_path / 'runs'}",
                *rl_pipeline.settings(task, "pipe.", steps, G=4, n=4),
            ],
            environ={},
        )
        ensure_topics(cfg)

        def chaos():  # waits on the trainer's durable steps log, not on time; ``abort``: the test failed
            def logged(n: int) -> bool:
                return abort.is_set() or len(read_steps_log(Path(cfg.run_dir) / "trainer")) >= n

            if wait_for(lambda: logged(1), 900, 0.5) and not abort.is_set():
                cluster.kill(2, signal.SIGKILL)
                faults.append("killed")
                if wait_for(lambda: logged(3), 900, 0.5) and not abort.is_set():
                    cluster.start_node(2, progress=print)
                    faults.append("restarted")

        t = threading.Thread(target=chaos, daemon=True)
        t.start()
        out = rl_pipeline.run(cfg, steps, rollout_workers=1, timeout=900)
        t.join(400)  # the restart, if the run was faster than it
        log = read_steps_log(Path(cfg.run_dir) / "trainer")
        assert [e["step"] for e in log] == list(range(1, steps + 1))
        assert faults == ["killed", "restarted"], faults
        print(f"[cluster pipeline] {steps} steps in {out['seconds']:.0f} s through {faults}")
    finally:
        abort.set()
        if t is not None:
            t.join(400)  # no restart may race the stop
        cluster.stop(progress=print)
