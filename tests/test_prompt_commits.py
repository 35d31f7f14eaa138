"""The rollout's prompt commits (``producers.commits.PromptCommits``) against a real broker, without a
worker: offsets go in only in order and once acknowledged; a rewound or lost partition is forgotten."""

from __future__ import annotations

import time

import pytest

from pipeline.admin import Admin
from pipeline.kafka import Consumer, Producer, client_conf
from pipeline.metrics import WorkerMetrics
from producers.commits import PromptCommits

pytestmark = pytest.mark.kafka


def test_offsets_commit_in_order_only_once_acknowledged(make_config):
    cfg = make_config("topics.prompts.partitions=1")
    topic, group = cfg.topics.name("prompts"), f"{cfg.topics.prefix}commits"
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        for i in range(4):
            p.produce(topic, f"p{i}".encode())
    metrics = WorkerMetrics("rollout", "t")
    commits = PromptCommits(metrics, 30.0)
    consumer = Consumer({**client_conf(cfg, "test", kind="consumer"), "on_commit": commits.on_commit}, group)
    finished: list = []
    commits.subscribe(consumer, topic, finished.append, lambda pred: None, lambda: False)
    admin = Admin(client_conf(cfg, "test"))
    try:
        msgs, deadline = [], time.monotonic() + 60
        while len(msgs) < 4 and time.monotonic() < deadline:
            msgs += consumer.consume(4 - len(msgs), 0.5)
        tp = (topic, 0)
        acks = [commits.acker(tp, m.offset(), commits.track(tp, m.offset(), 2)) for m in msgs]
        for cb in (acks[0], acks[0], acks[1], acks[2], acks[2]):  # message 1 still waits for one ack
            cb(None, None)
        assert commits.outstanding() == 2
        commits.commit(force=True)
        assert admin.committed(group, topic, 1)[0] == 1  # after message 0 only: 1 blocks 2
        acks[1](None, None)
        commits.commit(force=True)
        assert admin.committed(group, topic, 1)[0] == 3 and not commits.to_commit
        # a re-delivery from an earlier offset: a new ledger generation; old acks no longer count
        assert commits.restart_if_rewound(tp, 2) and metrics.counters["partition_rewinds"] == 1
        acks[3](None, None)
        acks[3](None, None)
        commits.commit(force=True)
        assert admin.committed(group, topic, 1)[0] == 3
        assert commits.outstanding() == 0
    finally:
        consumer.close()  # the final revoke finishes (here: nothing) and forgets the partition
    assert finished and not commits.ledger.parts
