"""Topics take the cluster's replication by default (``pipeline.admin.replication``: 3 nodes ->
3 replicas and min.insync.replicas 2, 1 node -> 1 replica), and an explicit replication factor above
the broker count is refused in one line before any topic is created. The broker count is read from
the real test broker's metadata."""

from __future__ import annotations

import pytest

from pipeline.admin import Admin, ensure_topics, replication
from pipeline.errors import ConfigError
from pipeline.kafka import client_conf
from tests.conftest import run_cli


def test_the_decision():
    assert replication(1, None, None) == (1, None)
    assert replication(2, None, None) == (2, None)
    assert replication(3, None, None) == (3, 2)
    assert replication(5, None, None) == (3, 2)
    assert replication(5, 5, None) == (5, 4)
    assert replication(3, 3, 3) == (3, 3)
    assert replication(3, 1, None) == (1, None)
    for brokers, rf, isr, says in (
        (1, 3, None, "has 1 broker"),
        (3, 4, None, "has 3 broker"),
        (1, None, 2, "1 replica"),
    ):
        with pytest.raises(ConfigError, match=says) as err:
            replication(brokers, rf, isr)
        assert "\n" not in str(err.value)


def _admin(cfg) -> Admin:
    return Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)


@pytest.mark.kafka
def test_topics_take_the_clusters_replication(make_config):
    cfg = make_config(create=False)
    if cfg.topics.replication_factor is not None:
        pytest.skip("this test run sets topics.replication_factor for its cluster")
    admin = _admin(cfg)
    try:
        brokers = admin.broker_count()
        rf, isr = replication(brokers, None, None)
        ensure_topics(cfg)
        names = [cfg.topics.name(r) for r in cfg.topics.specs()]
        info = admin.describe(names)
        assert {i.replication_factor for i in info.values()} == {rf}
        if isr is not None:
            assert {i.configs.get("min.insync.replicas") for i in info.values()} == {str(isr)}
    finally:
        admin.close()


@pytest.mark.kafka
def test_more_replicas_than_brokers_is_refused_in_one_line(make_config, cli_env, topic_prefix):
    probe = make_config(create=False)
    admin = _admin(probe)
    try:
        too_many = admin.broker_count() + 1
        cfg = make_config(f"topics.replication_factor={too_many}", create=False)
        with pytest.raises(ConfigError, match=f"topics.replication_factor = {too_many}"):
            ensure_topics(cfg)
        env = {**cli_env, "RLSTREAM_TOPICS__REPLICATION_FACTOR": str(too_many)}
        proc = run_cli(["topics", "create"], env, timeout=120, check=False)
        out = proc.stdout + proc.stderr
        said = [line for line in out.splitlines() if "replication_factor" in line]
        assert proc.returncode != 0 and len(said) == 1 and "Traceback" not in out, out
        assert not [t for t in admin.list_topics() if t.startswith(topic_prefix)]  # nothing created
    finally:
        admin.close()
