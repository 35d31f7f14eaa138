"""The reward worker in-process against a real broker: bad input and failing rewards go to the DLQ
inside the batch's transaction while their neighbours are scored; an aborted transaction is
rewound; a zombie with the same transactional id is fenced; metrics are published."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest
from confluent_kafka import KafkaError

from consumers.reward.worker import RewardWorker, whole_groups
from pipeline import codec
from pipeline.admin import Admin
from pipeline.errors import KafkaClientError, TopicError
from pipeline.kafka import Consumer, ExactlyOnceLoop, Producer, client_conf, decode_message, wait_for
from tests.test_codec import make_trajectory

pytestmark = pytest.mark.kafka


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_thread(worker: RewardWorker) -> tuple[threading.Thread, list[BaseException]]:
    """``worker.run()`` on a started daemon thread; what it raised lands in the list."""
    errors: list[BaseException] = []

    def target():
        try:
            worker.run()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, errors


@contextmanager
def running(worker: RewardWorker):
    """Run ``worker`` in a thread; on exit stop it and re-raise what it raised."""
    t, errors = in_thread(worker)
    try:
        yield errors
    finally:
        worker.stop()
        t.join(60)
        assert not t.is_alive(), "worker did not stop"
    if errors:
        raise errors[0]


def traj(i: int, text: str, group: str = "g1") -> dict:
    t = make_trajectory(i, 4)
    t.update(trajectory_id=f"{group}/{i}", group_id=group, sample_index=i, group_size=max(4, i + 1), response_text=text)
    return t


def produce(cfg, items: list[tuple[bytes, bytes]], partition: int | None = 0) -> None:
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        for key, value in items:
            p.produce(cfg.topics.name("rollouts"), value, key=key, partition=partition, headers={"h": b"1"})


def read_all(cfg, role: str, min_count: int = 0, timeout: float = 60.0) -> list:
    """Every committed record of a topic up to its end (read_committed), after at least ``min_count``."""
    deadline = time.monotonic() + timeout
    while True:
        with Consumer(client_conf(cfg, "test", kind="consumer")) as c:
            out = c.read_to_end(cfg.topics.name(role), timeout=max(10.0, deadline - time.monotonic()))
        if len(out) >= min_count or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def test_failures_go_to_dlq_in_the_same_transaction_as_their_scored_neighbours(make_config, tmp_path):
    port = free_port()
    cfg = make_config(
        'reward.default=[{name="tests.test_reward_fns:picky"}]',
        "reward.timeout_s=2.0",
        "reward.pool_size=2",
        "reward.max_batch_size=8",
        "reward.max_batch_ms=5000",
        "reward.batch_idle_ms=0",  # the eight already queued make one batch however slow the fetch
        "reward.worker_id=w-dlq",
        "reward.metrics_interval_s=0.5",
        f"reward.prometheus_port={port}",
    )
    texts = ["ok-1", "RAISE", "ok-2", "HANG", "ok-3"]
    items = [(b"g1", codec.encode("Trajectory", traj(i, t))) for i, t in enumerate(texts)]
    prompt = {"prompt_id": "p", "group_id": "g1", "task": "t", "text": "x", "group_size": 1, "sample_count": 1,
              "created_at_ms": 1}  # fmt: skip
    items += [
        (b"g1", b"\x00 definitely not avro"),
        (b"g1", codec.encode("Prompt", prompt)),
        (b"g1", codec.encode("Trajectory", traj(7, "ok-4"))),
    ]
    produce(cfg, items)
    w = RewardWorker(cfg)
    with running(w):
        scored = read_all(cfg, "scored", 4)
        dead = read_all(cfg, "dlq", 4)
        assert w.metrics.counters["transactions"] == 1  # all eight were one batch, one transaction
        produce(cfg, [(b"g1", codec.encode("Trajectory", traj(8, "ok-5")))])  # the worker goes on
        assert len(read_all(cfg, "scored", 5)) == 5
        assert wait_for(lambda: w.metrics.counters.get("transactions") == 2, 30)
        time.sleep(1.0)  # let one more metrics interval pass, then scrape
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    recs = [decode_message(m, "ScoredTrajectory") for m in scored]
    assert sorted(r["trajectory"]["response_text"] for r in recs) == ["ok-1", "ok-2", "ok-3", "ok-4"]
    for m, r in zip(scored, recs, strict=True):
        assert m.key() == b"g1" and r["reward"] == 1.0 and r["scorer_id"] == "w-dlq"
        assert r["source_partition"] == 0 and r["source_offset"] == r["trajectory"]["sample_index"]
    dl = {d["source_offset"]: d for d in (decode_message(m, "DeadLetter") for m in dead)}
    assert {o: d["error_type"] for o, d in dl.items()} == {
        1: "reward_error",
        3: "reward_timeout",
        5: "decode",
        6: "schema",
    }
    assert "ValueError: picky refuses RAISE" in dl[1]["reason"]
    assert "exceeded 2.0 s" in dl[3]["reason"]
    assert "bad magic" in dl[5]["reason"] and "expected Trajectory" in dl[6]["reason"]
    for o, d in dl.items():
        assert d["value"] == items[o][1] and d["key"] == b"g1" and d["source_topic"] == cfg.topics.name("rollouts")
        assert d["headers"] == {"h": b"1"} and d["role"] == "reward" and d["worker_id"] == "w-dlq"
    assert all(m.key() == b"g1" for m in dead)
    committed = Admin(client_conf(cfg, "test")).committed(cfg.reward.group_id, cfg.topics.name("rollouts"), 8)
    assert committed[0] == 9
    # metrics: on the metrics topic, keyed reward/<worker>, and on Prometheus
    events = [(m.key(), decode_message(m, "MetricEvent")) for m in read_all(cfg, "metrics", 1)]
    assert events and all(k == b"reward/w-dlq" and e["role"] == "reward" for k, e in events)
    last = events[-1][1]["metrics"]
    assert last["task.copy.count"] == 5 and last["task.copy.reward_mean"] == 1.0
    assert last["task.copy.reward_le_1"] == 5 and last["task.copy.reward_le_0.5"] == 0
    assert last["dead_letters.reward_timeout"] == 1 and last["dead_letters.decode"] == 1 and last["consumed"] == 9
    assert "consumed_rate" in last
    assert 'rlstream_task_copy_count{role="reward",worker="w-dlq"} 5.0' in body
    resolved = cfg.run_dir / "reward-w-dlq.resolved.toml"
    assert 'worker_id = "w-dlq"' in resolved.read_text()


def abortable() -> KafkaClientError:
    """An abortable commit error, as a broker-side transaction error would be."""
    return KafkaClientError("injected", KafkaError(KafkaError._FAIL, "injected", txn_requires_abort=True))


class AbortOnceLoop(ExactlyOnceLoop):
    """Fails the first commit with an abortable error."""

    fails = 1

    def _commit(self, watch):
        if self.fails:
            self.fails -= 1
            raise abortable()
        super()._commit(watch)


class AbortOnce(RewardWorker):
    txn_loop = AbortOnceLoop


def test_a_batch_closes_once_nothing_new_arrives(make_config):
    """reward.batch_idle_ms: a batch of three that cannot fill (max_batch_size 100) is scored long
    before max_batch_ms (5 minutes) runs out; with batch_idle_ms = 0 it would wait all of it."""
    cfg = make_config(
        "reward.executor=thread", "reward.max_batch_size=100", "reward.max_batch_ms=300000",
        "reward.batch_idle_ms=50", "reward.max_poll_interval_ms=900000",
    )  # fmt: skip
    produce(cfg, [(b"g1", codec.encode("Trajectory", traj(i, "abc"))) for i in range(3)])
    w = RewardWorker(cfg)

    def transactions():  # the metrics exist once the worker is set up
        return w.metrics.counters.get("transactions", 0) if w.metrics is not None else 0

    with running(w):
        assert wait_for(lambda: transactions() == 1, 120), "the batch never closed"
        produce(cfg, [(b"g1", codec.encode("Trajectory", traj(i, "abc"))) for i in range(3, 5)])
        assert wait_for(lambda: transactions() == 2, 120)
        assert len(read_all(cfg, "scored", 5)) == 5


@pytest.mark.parametrize("whole", [True, False])
def test_a_batch_of_whole_groups_closes_without_waiting_for_the_idle_window(make_config, whole):
    """reward.close_whole_groups: with a quiet window (batch_idle_ms) of four minutes, a batch that
    holds every sample of its group (rl.group_size = 4, one key) is scored at once; a group that
    lacks a sample keeps the batch open; false waits out the window even for a whole group."""
    cfg = make_config(
        "reward.executor=thread", "reward.max_batch_size=100", "reward.max_batch_ms=300000",
        "reward.batch_idle_ms=240000", "reward.max_poll_interval_ms=900000", "rl.group_size=4",
        f"reward.close_whole_groups={str(whole).lower()}",
    )  # fmt: skip
    w = RewardWorker(cfg)

    def transactions():  # the metrics exist once the worker is set up
        return w.metrics.counters.get("transactions", 0) if w.metrics is not None else 0

    with running(w):
        assert wait_for(lambda: w.consumer is not None and w.consumer.assignment(), 120), "no partitions assigned"
        produce(cfg, [(b"g1", codec.encode("Trajectory", traj(i, "abc", "g1"))) for i in range(4)])
        if not whole:
            assert wait_for(lambda: len(w._buffer) == 4, 120), "the group was not read"  # the open batch
            time.sleep(3.0)  # (the window is 240 s: a batch closed here was not closed by it)
            assert transactions() == 0
            return
        assert wait_for(lambda: transactions() == 1, 120), "a whole group waited for the idle window"
        produce(cfg, [(b"g2", codec.encode("Trajectory", traj(i, "abc", "g2"))) for i in range(3)])
        assert wait_for(lambda: len(w._buffer) == 3, 120), "the part group was not read"  # the open batch
        time.sleep(3.0)  # three of four: the batch stays open (a close would show within this)
        assert transactions() == 1
        produce(cfg, [(b"g2", codec.encode("Trajectory", traj(3, "abc", "g2")))])
        assert wait_for(lambda: transactions() == 2, 120), "the completed group waited for the idle window"
        assert len(read_all(cfg, "scored", 8)) == 8


def test_whole_groups_counts_samples_per_key():
    class Msg:  # the one attribute whole_groups reads off a consumed message
        def __init__(self, key):
            self._key = key

        def key(self):
            return self._key

    two = [Msg(b"a"), Msg(b"b"), Msg(b"a"), Msg(b"b")]
    assert whole_groups(two, 2) and not whole_groups(two, 3)
    assert not whole_groups([*two, Msg(b"c")], 2)  # a third group with one sample of two
    assert not whole_groups([*two, Msg(None)], 1)  # a keyless message: its group is unknown
    assert whole_groups([*two, Msg(b"a")], 2)  # more than a group's size (a regenerated sample)


def test_aborted_transaction_is_rewound_and_retried(make_config):
    cfg = make_config("reward.executor=thread", "reward.max_batch_size=50", "reward.max_batch_ms=2000")
    n = 40
    produce(
        cfg, [(f"g{i % 4}".encode(), codec.encode("Trajectory", traj(i, "abc", f"g{i % 4}"))) for i in range(n)], None
    )
    w = AbortOnce(cfg)
    with running(w):
        scored = read_all(cfg, "scored", n)
        assert wait_for(lambda: w.metrics.counters.get("consumed") == n, 30)
    ids = [decode_message(m, "ScoredTrajectory")["trajectory"]["trajectory_id"] for m in scored]
    assert len(ids) == n and len(set(ids)) == n  # the aborted batch was re-read, not skipped or doubled
    assert w.metrics.counters["txn_aborts"] == 1
    assert read_all(cfg, "dlq") == []


class FailSecondCommit(RewardWorker):
    """Fails its second commit with an abortable error. With ``overlap_commit`` that commit runs on
    the commit thread, and it first waits until the main thread has read the batch after it."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.commits = 0
        self.batches: list[list[int]] = []  # the offsets of every batch processed, in order
        self.meanwhile: int | None = None  # index of the batch read while the failing commit ran
        worker = self

        class Loop(ExactlyOnceLoop):
            def _end_txn(self, txn, watch):
                offsets = [m.offset() for m in txn.batch]
                worker.committing = len(worker.batches) - 1 - worker.batches[::-1].index(offsets)
                super()._end_txn(txn, watch)

            def _commit(self, watch):
                worker.commits += 1
                if worker.commits == 2:
                    if self.overlap:
                        nxt = worker.committing + 1
                        assert wait_for(lambda: len(worker.batches) > nxt, 60), "no batch was read during the commit"
                        worker.meanwhile = nxt
                    raise abortable()
                super()._commit(watch)

        self.txn_loop = Loop

    def _process(self, batch):
        self.batches.append([m.offset() for m in batch])
        super()._process(batch)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_commit_rewinds_its_batch_and_the_batch_read_meanwhile(make_config, overlap):
    cfg = make_config(
        "topics.rollouts.partitions=1",
        "reward.executor=thread",
        "reward.max_batch_size=8",
        "reward.max_batch_ms=500",
        f"reward.overlap_commit={str(overlap).lower()}",
    )
    n = 40
    produce(cfg, [(b"g", codec.encode("Trajectory", traj(i, "abc", "g"))) for i in range(n)])
    w = FailSecondCommit(cfg)
    with running(w):
        scored = read_all(cfg, "scored", n)
        assert wait_for(lambda: w.metrics.counters.get("consumed") == n, 60)
    ids = [decode_message(m, "ScoredTrajectory")["trajectory"]["trajectory_id"] for m in scored]
    assert len(ids) == n and len(set(ids)) == n  # nothing skipped, nothing scored twice
    assert w.metrics.counters["txn_aborts"] == 1
    if overlap:  # the batch read while the failed commit ran was dropped and read again
        later = {o for b in w.batches[w.meanwhile + 1 :] for o in b}
        assert w.batches[w.meanwhile] and set(w.batches[w.meanwhile]) <= later


class CrashInCommitLoop(ExactlyOnceLoop):
    """A bug on the commit path, before the transaction's checkpoint."""

    def _end_txn(self, txn, watch):
        raise RuntimeError("bug in the commit path")


class CrashInCommit(RewardWorker):
    txn_loop = CrashInCommitLoop


@pytest.mark.parametrize("overlap", [True, False])
def test_a_crash_in_the_commit_path_ends_the_worker_at_once(make_config, overlap):
    """Not a Kafka error: the worker re-raises it on its main thread (exit non-zero) instead of
    waiting out the commit bound for a checkpoint that never comes."""
    cfg = make_config(
        "topics.rollouts.partitions=1", "reward.executor=thread", f"reward.overlap_commit={str(overlap).lower()}"
    )
    produce(cfg, [(b"g", codec.encode("Trajectory", traj(0, "abc", "g")))])
    w = CrashInCommit(cfg)
    with pytest.raises(RuntimeError, match="bug in the commit path"):
        with running(w) as errors:
            assert wait_for(lambda: errors, 120), "the worker did not fail"  # running() re-raises it


def test_zombie_is_fenced_by_a_worker_with_the_same_id(make_config):
    cfg = make_config(
        "topics.rollouts.partitions=1", "reward.executor=thread", "reward.worker_id=same", "reward.max_batch_ms=50"
    )
    zombie, fresh = RewardWorker(cfg), RewardWorker(cfg)
    with pytest.raises(KafkaClientError) as ei:
        with running(zombie):
            assert wait_for(lambda: zombie.consumer is not None and zombie.consumer.assignment(), 30)
            with running(fresh):  # init_transactions with the same transactional.id fences the zombie
                assert wait_for(lambda: fresh.consumer is not None, 30)
                produce(cfg, [(b"g1", codec.encode("Trajectory", traj(0, "abc")))])
                scored = read_all(cfg, "scored", 1)  # the zombie fails, its partition moves to fresh
    assert ei.value.fatal
    assert [decode_message(m, "ScoredTrajectory")["trajectory"]["trajectory_id"] for m in scored] == ["g1/0"]


def test_missing_topics_are_a_clear_error(make_config):
    cfg = make_config("reward.executor=thread", "liveness.startup_timeout_s=3", create=False)
    with pytest.raises(TopicError, match="rlstream topics create"):
        RewardWorker(cfg).run()
