"""Issue 24 point 3: a transaction client that is safe without KIP-890. librdkafka (under
confluent-kafka) does not implement KIP-890 (#5423): a commit that times out and is retried in
the same producer epoch can leave requests of that epoch in flight that land after the transaction
ended (the "hanging transaction" of KAFKA-17754). The exactly-once loop therefore never retries an
end of transaction whose outcome is unknown: it replaces the producer (same transactional id, so
``init_transactions`` bumps the epoch, fencing the old requests, and completes or aborts the old
transaction) and reads on from the group's committed offsets.

The test pauses the broker (SIGSTOP; with one broker, the transaction and group coordinator) for
longer than ``kafka.request_timeout_s`` while a reward worker commits, then audits rl.scored with a
read_committed reader: every rollout scored once (no loss, no duplicate, no aborted record read, no
half of a transaction), and the producer was replaced rather than the commit retried.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from consumers.reward.worker import RewardWorker
from pipeline import codec
from pipeline.admin import ensure_topics
from pipeline.kafka import ExactlyOnceLoop, decode_message, wait_for
from rlstream.config import load_config
from tests.kafka_fixture import own_broker
from tests.test_reward_worker import produce, read_all, running, traj

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REQUEST_TIMEOUT_S = 5.0
PAUSE_S = 3 * REQUEST_TIMEOUT_S


class PauseBrokerInCommit(ExactlyOnceLoop):
    """Pauses the broker (once) just before the third transaction's commit, for ``PAUSE_S``."""

    broker_pid = 0
    commits = 0
    paused = threading.Event()

    def _commit(self, watch) -> None:
        cls = type(self)
        cls.commits += 1
        if cls.commits == 3:
            os.kill(cls.broker_pid, signal.SIGSTOP)
            cls.paused.set()
            threading.Timer(PAUSE_S, os.kill, (cls.broker_pid, signal.SIGCONT)).start()
        super()._commit(watch)


class Worker(RewardWorker):
    txn_loop = PauseBrokerInCommit


def test_a_commit_that_times_out_replaces_the_producer_and_loses_nothing(tmp_path):
    with own_broker(tmp_path / "broker") as state:
        PauseBrokerInCommit.broker_pid = state["pid"]
        cfg = load_config(
            None,
            [
                f"kafka.bootstrap_servers={state['bootstrap']}",
                f"kafka.request_timeout_s={REQUEST_TIMEOUT_S}",
                "topics.prefix=uncertain.",
                f"run_dir={tmp_path / 'runs'}",
                "topics.rollouts.partitions=2",
                "reward.executor=thread",
                "reward.worker_id=r0",
                "reward.max_batch_size=10",
                "reward.max_batch_ms=100",
            ],
            environ={},
        )
        ensure_topics(cfg)
        n = 60
        rollouts = [(f"g{i % 4}".encode(), codec.encode("Trajectory", traj(i, "abc", f"g{i % 4}"))) for i in range(n)]
        w = Worker(cfg)
        with running(w) as errors:
            produce(cfg, rollouts[:30], None)
            assert wait_for(lambda: PauseBrokerInCommit.paused.is_set() or errors, 180), "never paused"
            produce(cfg, rollouts[30:], None)  # queued while the broker is paused
            scored = read_all(cfg, "scored", n, timeout=300)
            assert not errors, errors
            replaced = w.metrics.counters.get("producers_replaced", 0)
        ids = [decode_message(m, "ScoredTrajectory")["trajectory"]["trajectory_id"] for m in scored]
        assert sorted(ids) == sorted(f"g{i % 4}/{i}" for i in range(n)), "lost or scored twice"
        assert replaced >= 1, "the timed-out commit was retried in the same producer epoch"
