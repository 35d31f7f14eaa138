"""Foundation against a real broker: topics, producer/consumer wrappers, codec on the wire."""

import os
import random
import shutil
import time
from pathlib import Path

import pytest

from pipeline import codec
from pipeline.admin import Admin, ensure_topics
from pipeline.errors import DecodeError, DeliveryError
from pipeline.kafka import Consumer, Producer, TopicPartition, client_conf, decode_message
from pipeline.ports import pid_alive
from tests.conftest import run_cli
from tests.helpers import murmur2_partition
from tests.test_codec import make_trajectory

pytestmark = pytest.mark.kafka


def consume_all(cfg, topic: str, expected: int, timeout: float = 120.0):
    admin = Admin(client_conf(cfg, "test"))
    parts = admin.describe([topic])[topic].partitions
    c = Consumer(client_conf(cfg, "test", kind="consumer"))
    c.assign([TopicPartition(topic, p, 0) for p in range(parts)])
    out, deadline = [], time.monotonic() + timeout
    try:
        while len(out) < expected and time.monotonic() < deadline:
            out.extend(c.consume(1000, 1.0))
    finally:
        c.close()
    return out


def test_topics_create_is_idempotent(make_config):
    cfg = make_config(create=False)
    first = ensure_topics(cfg)
    assert set(first.values()) == {"created"} and len(first) == 6
    assert set(ensure_topics(cfg).values()) == {"exists"}
    # A changed spec is brought in line on the next run, not an error.
    cfg2 = make_config("topics.rollouts.retention_ms=3600000", "topics.rollouts.partitions=10", create=False)
    res = ensure_topics(cfg2)
    assert res[cfg2.topics.name("rollouts")] == "updated"
    info = Admin(client_conf(cfg2, "test")).describe([cfg2.topics.name("rollouts")])[cfg2.topics.name("rollouts")]
    assert info.partitions == 10 and info.configs["retention.ms"] == "3600000"
    assert info.configs["max.message.bytes"] == str(16 * 1024 * 1024)


def test_topics_cli_twice(cli_env, kafka_bootstrap):
    out1 = run_cli(["topics", "create"], cli_env).stdout
    out2 = run_cli(["topics", "create"], cli_env).stdout
    assert out1.count("created") == 6 and out2.count("exists") == 6
    desc = run_cli(["topics", "describe", "--json"], cli_env).stdout
    assert f"{cli_env['RLSTREAM_TOPICS__PREFIX']}control" in desc
    run_cli(["topics", "delete", "--yes"], cli_env)
    assert run_cli(["topics", "create"], cli_env).stdout.count("created") == 6


def test_10k_trajectories_round_trip_byte_exact(make_config):
    cfg = make_config()
    topic = cfg.topics.name("rollouts")
    parts = cfg.topics.rollouts.partitions
    rng = random.Random(0)
    sent: dict[tuple[bytes, int], bytes] = {}
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        for i in range(10_000):
            t = make_trajectory(i // 10, 0, rng)
            t["prompt_tokens"] = codec.pack_i32(rng.randrange(50_000) for _ in range(512))
            t["response_tokens"] = codec.pack_i32(rng.randrange(50_000) for _ in range(768))
            t["logprobs"] = codec.pack_f32(-rng.random() for _ in range(768))
            t["trajectory_id"] = f"g{i // 10}/{i % 10}"
            value = codec.encode("Trajectory", t)
            key = t["group_id"].encode()
            sent[(key, i % 10)] = value
            p.produce(topic, value, key=key, headers={"i": str(i % 10)})
    assert 8000 <= len(value) <= 8600  # about 8 KB each
    msgs = consume_all(cfg, topic, 10_000)
    assert len(msgs) == 10_000
    seen = set()
    group_partition: dict[bytes, int] = {}
    for m in msgs:
        key = m.key()
        idx = int(dict(m.headers())["i"])
        assert m.value() == sent[(key, idx)]  # byte-exact
        assert m.partition() == murmur2_partition(key, parts)  # Java-compatible keyed placement
        assert group_partition.setdefault(key, m.partition()) == m.partition()
        seen.add((key, idx))
        decode_message(m, "Trajectory")
    assert len(seen) == 10_000  # no duplicates
    assert len(set(group_partition.values())) == parts  # keys spread over every partition


def test_undecodable_bytes_raise_typed_error(make_config):
    cfg = make_config()
    topic = cfg.topics.name("prompts")
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        p.produce(topic, b"\x00garbage", key=b"k", partition=2)
        p.produce(topic, codec.MAGIC + b"\x01" * 8 + b"x", key=b"k", partition=2)
    msgs = consume_all(cfg, topic, 2)
    with pytest.raises(DecodeError) as ei:
        decode_message(msgs[0], "Prompt")
    e = ei.value
    assert (e.topic, e.partition, e.offset) == (topic, 2, 0)
    assert f"topic={topic} partition=2 offset=0" in str(e)
    with pytest.raises(DecodeError) as ei:
        decode_message(msgs[1], "Prompt")
    assert ei.value.error_type == "schema" and ei.value.offset == 1


def test_delivery_error_is_raised_not_lost(make_config):
    cfg = make_config()
    p = Producer({**client_conf(cfg, "test", kind="producer"), "message.timeout.ms": 2000})
    p.produce(cfg.topics.prefix + "does-not-exist", b"x")
    with pytest.raises(DeliveryError):
        p.flush(10)
    p.produce(cfg.topics.name("dlq"), b"ok")  # the error was raised once, the producer still works
    p.flush(10)
    assert p.failed == 1 and p.delivered == 1


@pytest.mark.skipif(shutil.which("mvn") is None or shutil.which("java") is None, reason="needs java and mvn")
def test_broker_cli_lifecycle(tmp_path):
    """`rlstream broker start|status|logs|stop` on its own data dir; stop leaves no process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(RLSTREAM_BROKER__DATA_DIR=str(tmp_path / "b"), RLSTREAM_BROKER__PORT="0", RLSTREAM_BROKER__HEAP_MB="384")
    try:
        started = run_cli(["broker", "start"], env, timeout=300)
        bootstrap = started.stdout.strip().splitlines()[-1]
        again = run_cli(["broker", "start"], env)
        assert "already running" in again.stderr
        status = run_cli(["broker", "status"], env)
        assert bootstrap in status.stdout
        pid = int((tmp_path / "b" / "broker.pid").read_text())
        java_args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"-XX:TieredStopAtLevel=1" in java_args and b"-Xmx384m" in java_args  # broker.jvm_options, heap_mb
        assert "Kafka" in run_cli(["broker", "logs", "-n", "200"], env).stdout
        env_c = {**env, "RLSTREAM_KAFKA__BOOTSTRAP_SERVERS": bootstrap}
        assert run_cli(["topics", "create"], env_c).stdout.count("created") == 6
    finally:
        run_cli(["broker", "stop"], env, check=False)
    assert run_cli(["broker", "status"], env, check=False).returncode == 1
    assert not pid_alive(pid)  # gone (a zombie awaiting its reaper counts as gone)


def test_fenced_transactional_producer_fails_typed_and_closes(make_config):
    from pipeline.errors import KafkaClientError

    cfg = make_config()
    conf = client_conf(cfg, "test", kind="producer")
    tid = f"fence-{cfg.topics.prefix}"
    old = Producer(conf, transactional_id=tid)
    old.init_transactions()
    old.begin_transaction()
    old.produce(cfg.topics.name("dlq"), b"zombie")
    new = Producer(conf, transactional_id=tid)
    new.init_transactions()  # fences `old`
    with pytest.raises(KafkaClientError) as ei:
        old.commit_transaction(10)
    assert old.fatal and ei.value.fatal
    old.close()  # must not raise (confluent-kafka cannot flush a fenced client)
    new.begin_transaction()
    new.produce(cfg.topics.name("dlq"), b"ok")
    new.commit_transaction()
    new.close()


def test_the_kip848_protocol_leaves_out_the_classic_only_settings():
    """librdkafka refuses ``session.timeout.ms``, ``heartbeat.interval.ms`` and the assignment
    strategy with ``group.protocol=consumer`` (the broker owns them); the roles set them, so the
    wrapper leaves them out, and a user's ``kafka.consumer`` choice of the protocol works."""
    conf = {"bootstrap.servers": "127.0.0.1:1", "group.protocol": "consumer", "session.timeout.ms": 6000}
    c = Consumer({**conf, "heartbeat.interval.ms": 500}, group_id="g")
    try:
        c._c()  # the client is built (no broker needed)
        assert c.kip848 and not any(k in c._conf for k in ("session.timeout.ms", "heartbeat.interval.ms"))
        assert "partition.assignment.strategy" not in c._conf
    finally:
        c.close()
    classic = Consumer({**conf, "group.protocol": "classic"}, group_id="g")
    assert not classic.kip848 and classic._conf["session.timeout.ms"] == 6000


def test_a_static_member_handed_another_topics_assignment_fails_loudly(make_config):
    """A static member that rejoins within the session timeout gets its old assignment back, even
    when it now subscribes to other topics (another job with the same group and instance id): it
    would sit on the other topic's committed end, alive and idle. The wrapper raises instead, naming
    the group, the foreign topics and what to change; a dynamic member of another group is unaffected."""
    from pipeline.errors import ConsumeError

    cfg = make_config()
    old_topic, new_topic = cfg.topics.name("prompts"), cfg.topics.name("rollouts")
    conf = {**client_conf(cfg, "test", kind="consumer"), "group.instance.id": "slot-0", "session.timeout.ms": 30000}
    group = f"{cfg.topics.prefix}static"
    old = Consumer(conf, group_id=group)
    old.subscribe([old_topic])
    deadline = time.monotonic() + 120
    while not old.assignment():
        assert time.monotonic() < deadline, "the first member got no assignment within 120 s"
        old.poll(0.2)
    old.close()  # a static member does not leave its group on close
    new = Consumer(conf, group_id=group)
    new.subscribe([new_topic])
    deadline = time.monotonic() + 120
    try:
        with pytest.raises(ConsumeError) as ei:
            while time.monotonic() < deadline:
                new.poll(0.2)
        msg = str(ei.value)
        assert old_topic in msg and repr(group) in msg and "'slot-0'" in msg and "group_id" in msg
    finally:
        new.close()
    fresh = Consumer(client_conf(cfg, "test", kind="consumer"), group_id=f"{cfg.topics.prefix}dynamic")
    fresh.subscribe([new_topic])
    deadline = time.monotonic() + 120
    try:
        while not fresh.assignment():
            assert time.monotonic() < deadline, "a member of another group got no assignment within 120 s"
            fresh.poll(0.2)
        assert {t for t, _ in fresh.assignment()} == {new_topic}
    finally:
        fresh.close()


def test_a_connection_dropped_during_the_sasl_handshake_is_not_a_wrong_password(monkeypatch):
    """librdkafka reports a connection the broker dropped mid-handshake as an authentication error;
    a role retries it (no credential was checked) unless it keeps happening, while a refused password
    fails the role at once."""
    from confluent_kafka import KafkaError

    from pipeline.errors import KafkaClientError
    from pipeline.kafka import common

    monkeypatch.setattr(common, "_auth_error", [])
    monkeypatch.setattr(common, "_handshake_drops", [])
    drop = KafkaError(KafkaError._AUTHENTICATION, "GroupCoordinator: SASL SCRAM-SHA-512 mechanism handshake failed: "
                      "Local: Broker transport failure: broker's supported mechanisms: (n/a) (after 0ms in state DOWN)")  # fmt: skip
    most, _ = common.HANDSHAKE_DROPS
    for _ in range(most):
        common._on_client_error(drop)
        common.raise_if_auth_failed("prompts")
    common._on_client_error(drop)  # one more within the window: a listener that never completes a handshake
    with pytest.raises(KafkaClientError, match="authentication failed"):
        common.raise_if_auth_failed("prompts")
    monkeypatch.setattr(common, "_auth_error", [])
    monkeypatch.setattr(common, "_handshake_drops", [])
    refused = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed during "
                         "authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512")  # fmt: skip
    common._on_client_error(refused)
    with pytest.raises(KafkaClientError, match="invalid credentials"):
        common.raise_if_auth_failed("prompts")
