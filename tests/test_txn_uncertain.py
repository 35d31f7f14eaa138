"""A transaction client that is safe without KIP-890. librdkafka (under
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
from tests.test_reward_worker import in_thread, produce, read_all, running, traj

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REQUEST_TIMEOUT_S = 5.0
PAUSE_S = 3 * REQUEST_TIMEOUT_S


def setup(state: dict, tmp_path, prefix: str, *extra: str, n: int = 60):
    """A reward worker's config against the test's own broker (topics created) and ``n`` rollouts."""
    cfg = load_config(
        None,
        [
            f"kafka.bootstrap_servers={state['bootstrap']}",
            f"kafka.request_timeout_s={REQUEST_TIMEOUT_S}",
            f"topics.prefix={prefix}",
            f"run_dir={tmp_path / 'runs'}",
            "topics.rollouts.partitions=2",
            "reward.executor=thread",
            "reward.worker_id=r0",
            "reward.max_batch_size=10",
            "reward.max_batch_ms=100",
            *extra,
        ],
        environ={},
    )
    ensure_topics(cfg)
    return cfg, [(f"g{i % 4}".encode(), codec.encode("Trajectory", traj(i, "abc", f"g{i % 4}"))) for i in range(n)]


class PauseBrokerInCommit(ExactlyOnceLoop):
    """Pauses the broker (once) just before the third transaction's commit: for ``resume_after`` s,
    or (None) until the test resumes it; with ``worker`` set, asks that worker to stop right then."""

    broker_pid = 0
    commits = 0
    paused = threading.Event()
    resume_after: float | None = PAUSE_S
    worker = None

    def _commit(self, watch) -> None:
        cls = type(self)
        cls.commits += 1
        if cls.commits == 3:
            os.kill(cls.broker_pid, signal.SIGSTOP)
            cls.paused.set()
            if cls.resume_after is not None:
                threading.Timer(cls.resume_after, os.kill, (cls.broker_pid, signal.SIGCONT)).start()
            if cls.worker is not None:
                cls.worker.stop()
        super()._commit(watch)


class Worker(RewardWorker):
    txn_loop = PauseBrokerInCommit


def test_a_commit_that_times_out_replaces_the_producer_and_loses_nothing(tmp_path):
    with own_broker(tmp_path / "broker") as state:
        PauseBrokerInCommit.broker_pid = state["pid"]
        cfg, rollouts = setup(state, tmp_path, "uncertain.")
        n = len(rollouts)
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


class PauseThenStop(PauseBrokerInCommit):
    """The broker stays paused (the test resumes it) and the worker is told to stop at the pause:
    the producer replacement that follows the timed-out commit happens while stopping."""

    commits = 0
    paused = threading.Event()
    resume_after = None


class StoppingWorker(RewardWorker):
    txn_loop = PauseThenStop


def test_a_stop_during_an_uncertain_commit_ends_in_its_bound_and_the_next_worker_loses_nothing(tmp_path):
    """Without a coordinator to answer, the replacement's fencing gets one try within what is left of
    the stop bound (not the patient retry of a running worker, which outlived the bound and exited as
    hung): the worker stops while the broker is still paused, and the next worker with the same
    transactional id fences the open transaction and scores every rollout once."""
    with own_broker(tmp_path / "broker") as state:
        PauseThenStop.broker_pid = state["pid"]
        cfg, rollouts = setup(state, tmp_path, "stopping.", "liveness.shutdown_timeout_s=20")
        n = len(rollouts)
        w = PauseThenStop.worker = StoppingWorker(cfg)
        t, errors = in_thread(w)  # it stops by itself (PauseThenStop): not running(), which stops it
        produce(cfg, rollouts[:30], None)
        assert wait_for(lambda: PauseThenStop.paused.is_set() or errors, 180), "never paused"
        t.join(240)  # the broker stays paused all this time
        stopped_while_paused = not t.is_alive()
        os.kill(state["pid"], signal.SIGCONT)
        t.join(120)
        assert stopped_while_paused, "the stop waited for the paused coordinator"
        assert not errors, errors
        produce(cfg, rollouts[30:], None)
        with running(RewardWorker(cfg)) as errors2:  # the same transactional id: fences the open one
            scored = read_all(cfg, "scored", n, timeout=300)
            assert not errors2, errors2
        ids = [decode_message(m, "ScoredTrajectory")["trajectory"]["trajectory_id"] for m in scored]
        assert sorted(ids) == sorted(f"g{i % 4}/{i}" for i in range(n)), "lost or scored twice"
