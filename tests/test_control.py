"""Control plane: staleness and admission arithmetic, the checkpoint store, the control topic."""

import hashlib
import urllib.request

import pytest

from pipeline import checkpoint, codec, control
from pipeline.kafka import Consumer, Producer, client_conf
from pipeline.metrics import WorkerMetrics


@pytest.mark.parametrize("k", [0, 1, 3])
def test_admission_never_lets_a_sample_exceed_k(k):
    """Simulate the trainer consuming groups in seq order at G groups per version: every group a
    worker may admit at its loaded version is trained within k versions of it."""
    G = 4
    for loaded in range(10):
        admitted = [g for g in range(200) if control.may_admit(g, loaded, k, G)]
        assert admitted == list(range(control.admission_limit(loaded, k, G)))
        for g in admitted:
            trained_at = g // G  # version of the trainer when it consumes group g
            assert not control.is_stale(trained_at, loaded, k) or trained_at < loaded
            assert control.required_version(g, k, G) <= loaded


def test_k0_is_synchronous():
    G = 2
    # At version v exactly the groups of step v may start.
    assert [g for g in range(10) if control.may_admit(g, 3, 0, G)] == list(range(8))
    assert control.required_version(6, 0, G) == 3 and control.required_version(5, 0, G) == 2
    assert control.is_stale(5, 4, 0) and not control.is_stale(5, 5, 0)


def test_checkpoint_write_read_verify_gc(tmp_path):
    torch = pytest.importorskip("torch")
    store = str(tmp_path / "store")
    sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    for v in range(4):
        uri, sha, n = checkpoint.write_weights(store, v, {"w": sd["w"] + v})
        assert hashlib.sha256(open(uri, "rb").read()).hexdigest() == sha and n > 0
    back = checkpoint.read_weights(uri, sha)
    assert torch.equal(back["w"], sd["w"] + 3)
    with pytest.raises(checkpoint.ChecksumError):
        checkpoint.read_weights(uri, "0" * 64)
    deleted = checkpoint.gc_versions(store, keep=2)
    assert len(deleted) == 2
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["v00000002", "v00000003"]
    assert not list((tmp_path / "store").rglob("*.tmp-*"))  # no temp files left behind


@pytest.mark.kafka
def test_control_follower_sees_newest_notice_and_commands(make_config):
    cfg = make_config()
    topic = cfg.topics.name("control")

    def notice(v: int) -> dict:
        return {"version": v, "uri": f"file:///v{v}", "sha256": "x", "bytes": 1, "step": v, "created_at_ms": 1}

    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        for v in (1, 3, 2, 2):  # 3 does not follow 1: dead-lettered; the second 2 is a re-publication
            control.publish_weight_update(p, topic, notice(v))
        control.publish_command(p, topic, "stop", {"why": "test"})
        p.produce(topic, b"garbage")  # skipped with a log line, not fatal
    f = control.ControlFollower(cfg, "test")
    try:
        latest = f.catch_up(timeout=20)
        assert latest["version"] == 2 and f.dead_lettered == 1
        assert [c["name"] for c in f.commands] == ["stop"]
        with Producer(client_conf(cfg, "test", kind="producer")) as p:
            control.publish_weight_update(p, topic, notice(3))
        assert f.wait_for_version(3, timeout=20)["version"] == 3
        f.reject(f.latest_update, "unverifiable_checkpoint", "test")  # falls back to the one before
        assert f.latest_update["version"] == 2 and f.dead_lettered == 2
    finally:
        f.close()
    from tests.rollout_helpers import read_topic

    dl = read_topic(cfg, "dlq", "DeadLetter", min_count=2)
    assert [d["error_type"] for _, d in dl] == ["implausible_version", "unverifiable_checkpoint"]


@pytest.mark.kafka
def test_metrics_publish_to_topic_and_prometheus(make_config):
    from pipeline.kafka import TopicPartition

    cfg = make_config()
    topic = cfg.topics.name("metrics")
    p = Producer(client_conf(cfg, "test", kind="producer"))
    m = WorkerMetrics("reward", "w1", p, topic, interval_s=0, prometheus_port=0)
    m.inc("scored", 5)
    m.observe("latency_ms", 2.0)
    m.observe("latency_ms", 4.0)
    m.version = 7
    ev = m.publish()
    p.flush()
    assert ev["metrics"]["scored"] == 5 and ev["metrics"]["latency_ms_mean"] == 3.0
    c = Consumer(client_conf(cfg, "test", kind="consumer"))
    c.assign([TopicPartition(topic, 0, 0)])
    msgs = []
    for _ in range(30):
        msgs += c.consume(10, 1.0)
        if msgs:
            break
    c.close()
    assert msgs[0].key() == b"reward/w1"
    rec = codec.decode_as(msgs[0].value(), "MetricEvent")
    assert rec["version"] == 7 and rec["metrics"]["scored"] == 5.0


def test_prometheus_endpoint_serves_metrics():
    from pipeline.ports import free_port

    port = free_port()
    m = WorkerMetrics("trainer", "t0", prometheus_port=port)
    try:
        m.set("loss", 0.25)
        m.version = 2
        m.publish()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'rlstream_loss{role="trainer",worker="t0"} 0.25' in body
        assert 'rlstream_policy_version{role="trainer",worker="t0"} 2.0' in body
    finally:
        m.close()


def test_prometheus_has_no_policy_version_for_a_worker_without_weights():
    from pipeline.ports import free_port

    port = free_port()
    m = WorkerMetrics("reward", "w0", prometheus_port=port)  # never holds weights: version stays -1
    try:
        m.inc("scored", 3)
        m.publish()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'rlstream_scored{role="reward",worker="w0"} 3.0' in body
        assert "rlstream_policy_version" not in body  # Grafana's version panel would plot it at -1
    finally:
        m.close()
