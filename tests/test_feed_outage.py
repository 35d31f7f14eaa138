"""The feed's checkpoint rides out a broker that is away, as its flush does.

On a three-node cluster in `rlstream chaos --nodes 3` the feed exited 2 in the middle of a rolling
restart: its checkpoint reads the end offsets of rl.prompts, and that read gave up after
``kafka.request_timeout_s`` (``Local: Timed out``) while a node was shutting down, though the
checkpoint's flush just before it waits up to ``liveness.outage_s``. The test pauses its own broker
(SIGSTOP) for three request timeouts just before the first end-offsets read: the feed must finish,
feed every group once and record its state (a second run feeds nothing).
"""

from __future__ import annotations

import collections
import os
import signal
import threading

import pytest

from pipeline.admin import ensure_topics
from pipeline.kafka import Consumer, client_conf
from producers import feed
from rlstream.config import load_config
from tests.kafka_fixture import own_broker
from tests.rollout_helpers import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REQUEST_TIMEOUT_S = 5.0
PAUSE_S = 3 * REQUEST_TIMEOUT_S
DATA = "tests/data/prompts.jsonl"


class PausingConsumer(Consumer):
    """Pauses the broker for ``PAUSE_S`` before its first end-offsets read."""

    broker_pid = 0
    paused = threading.Event()

    def watermarks(self, topic, partition, timeout=30.0):
        cls = type(self)
        if not cls.paused.is_set():
            cls.paused.set()
            os.kill(cls.broker_pid, signal.SIGSTOP)
            threading.Timer(PAUSE_S, os.kill, (cls.broker_pid, signal.SIGCONT)).start()
        return super().watermarks(topic, partition, timeout)


class PausingFeed(feed.Feed):
    def checkpoint(self, next_g: int) -> None:
        if self._wm is None:
            self._wm = PausingConsumer(client_conf(self.cfg, "feed-wm", kind="consumer"))
        super().checkpoint(next_g)


def test_the_feed_checkpoint_waits_out_a_paused_broker(tmp_path):
    with own_broker(tmp_path / "broker") as state:
        PausingConsumer.broker_pid = state["pid"]
        cfg = load_config(
            None,
            [
                f"kafka.bootstrap_servers={state['bootstrap']}",
                f"kafka.request_timeout_s={REQUEST_TIMEOUT_S}",
                "liveness.outage_s=120",
                "topics.prefix=feedoutage.",
                f"run_dir={tmp_path / 'runs'}",
                f"feed.source={DATA}",
                "feed.limit=6",
                "feed.checkpoint_every=3",
            ],
            environ={},
        )
        ensure_topics(cfg)
        stats = PausingFeed(cfg).run(None)
        assert PausingConsumer.paused.is_set(), "the broker was never paused"
        assert stats["messages"] == 6
        assert feed.run(cfg)["messages"] == 0, "the feed's state was not recorded"
        seqs = collections.Counter(r["group_seq"] for _, r in read_topic(cfg, "prompts", "Prompt", 6, 60))
        assert sorted(seqs) == list(range(6)) and set(seqs.values()) == {1}
