"""The self-fencing crash: a reward worker that is a static member
(``reward.group_instance_id``) and finds its registration taken by a consumer with the same
``group.instance.id`` (after a broker restart librdkafka can do this to itself; here another
consumer does it on purpose) used to die with the fatal "Static consumer fenced by other consumer
with same group.instance.id". It now replaces its consumer in place: a new member with the same
instance id, which takes the registration back, reads on from the committed offsets, and scores
every rollout exactly once. A process that keeps being fenced (a second live process with the same
id) still exits, loudly, once its budget of replacements is spent."""

from __future__ import annotations

import threading

import pytest

from consumers.reward.worker import RewardWorker
from pipeline import codec
from pipeline.errors import ConsumeError
from pipeline.kafka import Consumer, client_conf, decode_message, wait_for
from tests.test_reward_worker import produce, read_all, running, traj

pytestmark = pytest.mark.kafka


def _settings(topic_prefix: str, *extra: str) -> list[str]:
    return [
        "topics.rollouts.partitions=2",
        "reward.executor=thread",
        "reward.worker_id=r0",
        "reward.group_instance_id=r0",
        f"reward.group_id={topic_prefix}-reward",
        "reward.max_batch_ms=200",
        "reward.session_timeout_ms=10000",
        *extra,
    ]


def _intruder(cfg, stop: threading.Event) -> Consumer:
    """A consumer with the worker's group and instance id; it polls until it owns partitions."""
    conf = {
        **client_conf(cfg, "intruder", kind="consumer"),
        "group.instance.id": cfg.reward.group_instance_id,
        "session.timeout.ms": cfg.reward.session_timeout_ms,
    }
    c = Consumer(conf, group_id=cfg.reward.group_id)
    c.subscribe([cfg.topics.name("rollouts")])
    assert wait_for(lambda: (c.poll(0.2) is None and bool(c.assignment())) or stop.is_set(), 120), "never assigned"
    return c


def _ids(cfg, n: int) -> list[str]:
    return [decode_message(m, "ScoredTrajectory")["trajectory"]["trajectory_id"] for m in read_all(cfg, "scored", n)]


def test_a_fenced_static_member_replaces_its_consumer_and_loses_nothing(make_config, topic_prefix):
    cfg = make_config(*_settings(topic_prefix))

    def batch(lo: int, hi: int) -> list[tuple[bytes, bytes]]:
        return [(f"g{i % 4}".encode(), codec.encode("Trajectory", traj(i, "abc", f"g{i % 4}"))) for i in range(lo, hi)]

    w = RewardWorker(cfg)
    stop = threading.Event()
    with running(w) as errors:
        produce(cfg, batch(0, 20), None)
        assert wait_for(lambda: len(read_all(cfg, "scored", 0, timeout=10)) >= 20 or errors, 120)
        intruder = _intruder(cfg, stop)  # takes the registration: the worker's next heartbeat is fenced
        produce(cfg, batch(20, 40), None)
        try:
            assert wait_for(lambda: w.metrics.counters.get("consumers_replaced", 0) >= 1 or errors, 120), (
                "the worker was never fenced"
            )
        finally:
            intruder.close()  # a static member leaves no LeaveGroup: the worker's new member takes over
        assert not errors, errors
        produce(cfg, batch(40, 60), None)
        ids = _ids(cfg, 60)
    assert sorted(ids) == sorted({f"g{i % 4}/{i}" for i in range(60)}) and len(ids) == 60  # once each
    assert read_all(cfg, "dlq") == []


def test_a_member_fenced_past_its_budget_exits_loudly(make_config, topic_prefix):
    cfg = make_config(*_settings(topic_prefix, "reward.max_consumer_replacements=0"))
    w = RewardWorker(cfg)
    stop = threading.Event()
    with pytest.raises(ConsumeError, match=r"group\.instance\.id"):
        with running(w) as errors:
            assert wait_for(lambda: (w.consumer is not None and w.consumer.assignment()) or errors, 120)
            intruder = _intruder(cfg, stop)
            try:
                assert wait_for(lambda: errors, 120), "the worker did not fail"  # running() re-raises it
            finally:
                intruder.close()
