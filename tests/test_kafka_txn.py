"""The exactly-once loop (``pipeline.kafka.ExactlyOnceLoop``) on its own, against a real broker and
with no role around it: a committed batch is visible with its offsets; a batch that fails inside its
transaction is aborted, invisible to read_committed readers and read again; a stuck producer is
replaced in-process; a second instance with the same transactional id fences the first."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError

from pipeline.admin import Admin
from pipeline.errors import ConsumeError, KafkaClientError
from pipeline.kafka import Consumer, ExactlyOnceLoop, Producer, WedgedClient, client_conf

pytestmark = pytest.mark.kafka

N = 6


@pytest.fixture
def stage(make_config):
    """A stage's plumbing: input (rollouts, 1 partition) holding N records, output (scored), a group."""
    cfg = make_config("topics.rollouts.partitions=1", "topics.scored.partitions=1")
    src, dst = cfg.topics.name("rollouts"), cfg.topics.name("scored")
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        for i in range(N):
            p.produce(src, f"in-{i}".encode(), key=b"k")
    return cfg, src, dst, f"{cfg.topics.prefix}txn-group"


def make_consumer(cfg, src: str, group: str) -> Consumer:
    c = Consumer(client_conf(cfg, "test", kind="consumer"), group_id=group)
    c.subscribe([src])
    return c


def read_batch(consumer: Consumer, n: int, timeout: float = 60.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += consumer.consume(n - len(out), 0.5)
    assert len(out) == n, f"read {len(out)} of {n}"
    return out


def read_output(cfg, topic: str, isolation: str = "read_committed") -> list[bytes]:
    conf = {**client_conf(cfg, "test", kind="consumer"), "isolation.level": isolation}
    with Consumer(conf) as c:
        return [m.value() for m in c.read_to_end(topic, timeout=30)]


class Events:
    """The hooks a stage gives the loop, recorded."""

    def __init__(self):
        self.committed, self.aborted, self.replaced = [], [], []

    def hooks(self) -> dict:
        return {
            "committed": lambda result, ms: self.committed.append(result),
            "aborted": self.aborted.append,
            "replaced": self.replaced.append,
        }


def make_loop(cfg, consumer, tid: str, events: Events, cls=ExactlyOnceLoop, overlap: bool = False):
    loop = cls(
        consumer,
        client_conf(cfg, "test", kind="producer"),
        tid,
        request_timeout_s=10.0,
        watchdog_s=60.0,
        outage_s=10.0,
        overlap=overlap,
        **events.hooks(),
    )
    loop.start()
    return loop


def close_stage(loop: ExactlyOnceLoop, consumer: Consumer) -> None:
    loop.close_committer(False)
    consumer.close()
    loop.close_producer(False)


def copy_into(loop: ExactlyOnceLoop, dst: str, batch: list):
    def produce():
        for m in batch:
            loop.produce(dst, b"out-" + m.value(), key=m.key())
        return len(batch)

    return produce


def committed_offset(cfg, group: str, topic: str) -> int:
    return Admin(client_conf(cfg, "test")).committed(group, topic, 1)[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_commits_with_its_offsets(stage, overlap):
    cfg, src, dst, group = stage
    consumer, events = make_consumer(cfg, src, group), Events()
    loop = make_loop(cfg, consumer, f"{group}-tid", events, overlap=overlap)
    try:
        first, second = read_batch(consumer, 4), read_batch(consumer, N - 4)
        assert loop.write(first, copy_into(loop, dst, first))
        assert loop.write(second, copy_into(loop, dst, second))  # with overlap: ends the first commit first
        loop.settle()
        assert not loop.rewound() and not loop.in_txn
    finally:
        close_stage(loop, consumer)
    assert events.committed == [4, N - 4] and not events.aborted
    assert read_output(cfg, dst) == [f"out-in-{i}".encode() for i in range(N)]
    assert committed_offset(cfg, group, src) == N  # the offsets committed inside the transactions


@pytest.mark.parametrize("overlap", [False, True])
def test_the_watchdog_allows_for_the_fault_injection_flush(stage, overlap):
    """With the fault-injection delay each transaction flushes (bounded by the request timeout, which
    a broker outage can use up) and then sleeps: the watchdog must allow for the flush, or a broker
    restart longer than the loop's own limit got the worker killed as hung (a CI failure of
    test_liveness's broker-restart test: exit 75 in the flush); the sleep, which stands for a worker
    stuck in a transaction, keeps the loop's limit (test_liveness's stuck-worker test)."""
    import contextlib

    cfg, src, dst, group = stage
    sections: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def section(what, seconds):
        sections.append((what, seconds))
        yield

    consumer, events = make_consumer(cfg, src, group), Events()
    loop = ExactlyOnceLoop(
        consumer, client_conf(cfg, "test", kind="producer"), f"{group}-tid",
        request_timeout_s=10.0, watchdog_s=1.0, outage_s=10.0, overlap=overlap, section=section,
        chaos_delay_s=0.2, **events.hooks(),
    )  # fmt: skip
    loop.start()
    try:
        batch = read_batch(consumer, N)
        assert loop.write(batch, copy_into(loop, dst, batch))
        loop.settle()
    finally:
        close_stage(loop, consumer)
    assert events.committed == [N]
    flush = [s for what, s in sections if what == ("transaction" if overlap else "transaction flush")]
    assert flush and max(flush) >= 10.0, sections  # the main thread waits through it with overlap
    if not overlap:  # the sleep (a worker stuck in a transaction) keeps the loop's limit
        assert ("transaction", 1.0) in sections, sections


class AbortableFailure(KafkaClientError):
    def __init__(self):
        super().__init__("injected", KafkaError(KafkaError._FAIL, "injected", txn_requires_abort=True))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failure_inside_the_batch_aborts_it_and_rewinds_the_input(stage, overlap):
    cfg, src, dst, group = stage
    consumer, events = make_consumer(cfg, src, group), Events()
    loop = make_loop(cfg, consumer, f"{group}-tid", events, overlap=overlap)
    try:
        batch = read_batch(consumer, N)

        def fail_midway():
            copy_into(loop, dst, batch[:3])()
            loop.producer.flush(10)  # the records really are on the broker, in the open transaction
            raise AbortableFailure()

        assert loop.write(batch, fail_midway)
        loop.settle()
        assert events.aborted and isinstance(events.aborted[0], AbortableFailure) and not events.committed
        assert read_output(cfg, dst) == []  # invisible to read_committed readers
        assert len(read_output(cfg, dst, "read_uncommitted")) == 3  # though they were written
        assert loop.rewound() == overlap  # seeks back to the batch's first offset (inline: write did)
        again = read_batch(consumer, N)
        assert [m.offset() for m in again] == [m.offset() for m in batch]  # re-delivered, all of it
        assert loop.write(again, copy_into(loop, dst, again))
        loop.settle()
    finally:
        close_stage(loop, consumer)
    assert events.committed == [N]
    assert read_output(cfg, dst) == [f"out-in-{i}".encode() for i in range(N)]  # once each
    assert committed_offset(cfg, group, src) == N


def test_a_failed_transaction_rewinds_the_batch_read_after_it_too(stage):
    """With overlap, batch N+1 is read while N commits; N fails: write(N+1) produces nothing and
    both are read again from N's first offset."""
    cfg, src, dst, group = stage
    consumer, events = make_consumer(cfg, src, group), Events()

    class FailFirstCommit(ExactlyOnceLoop):
        fails = 1

        def _commit(self, watch):
            if self.fails:
                self.fails -= 1
                raise AbortableFailure()
            super()._commit(watch)

    loop = make_loop(cfg, consumer, f"{group}-tid", events, cls=FailFirstCommit, overlap=True)
    try:
        first = read_batch(consumer, 2)
        assert loop.write(first, copy_into(loop, dst, first))
        second = read_batch(consumer, N - 2)  # read while the first commit is on the commit thread
        assert not loop.write(second, copy_into(loop, dst, second))  # the first failed: nothing written
        again = read_batch(consumer, N)
        assert [m.offset() for m in again] == list(range(N))
        assert loop.write(again, copy_into(loop, dst, again))
        loop.settle()
    finally:
        close_stage(loop, consumer)
    assert len(events.aborted) == 1 and events.committed == [N]
    assert read_output(cfg, dst) == [f"out-in-{i}".encode() for i in range(N)]


def test_a_stuck_producer_is_replaced_and_its_batch_read_again(stage):
    """A transaction call that never returns (WedgedClient, librdkafka #5456) replaces the producer
    in-process: the new one's init_transactions fences the old one and aborts its transaction."""
    cfg, src, dst, group = stage
    consumer, events = make_consumer(cfg, src, group), Events()

    class WedgedOnce(ExactlyOnceLoop):
        wedges = 1

        def _commit(self, watch):
            if self.wedges:
                self.wedges -= 1
                self.producer.flush(10)
                raise WedgedClient("commit_transaction did not return (injected)")
            super()._commit(watch)

    loop = make_loop(cfg, consumer, f"{group}-tid", events, cls=WedgedOnce)
    try:
        batch = read_batch(consumer, N)
        old = loop.producer
        assert loop.write(batch, copy_into(loop, dst, batch))  # fails inline, settles, rewinds
        assert loop.producer is not old and len(events.replaced) == 1 and not events.aborted
        assert read_output(cfg, dst) == []
        again = read_batch(consumer, N)
        assert loop.write(again, copy_into(loop, dst, again))
    finally:
        close_stage(loop, consumer)
    assert events.committed == [N]
    assert read_output(cfg, dst) == [f"out-in-{i}".encode() for i in range(N)]


def test_a_second_instance_with_the_same_transactional_id_fences_the_first(stage):
    cfg, src, dst, group = stage
    tid = f"{group}-tid"
    consumer, events = make_consumer(cfg, src, group), Events()
    zombie = make_loop(cfg, consumer, tid, events)
    batch = read_batch(consumer, N)
    fresh_consumer, fresh_events = make_consumer(cfg, src, f"{group}-2"), Events()
    fresh = make_loop(cfg, fresh_consumer, tid, fresh_events)  # init_transactions fences the zombie
    try:
        with pytest.raises(KafkaClientError) as ei:
            zombie.write(batch, copy_into(zombie, dst, batch))
        assert ei.value.fatal and not events.committed and not events.aborted  # fatal: raised, no retry
        zombie.close_producer(True)  # a fenced producer is abandoned, not flushed
        assert read_output(cfg, dst) == []
        theirs = read_batch(fresh_consumer, N)
        assert fresh.write(theirs, copy_into(fresh, dst, theirs))  # the new instance goes on
    finally:
        consumer.close()
        fresh_consumer.close()
        fresh.close_producer(False)
    assert fresh_events.committed == [N]
    assert read_output(cfg, dst) == [f"out-in-{i}".encode() for i in range(N)]


def test_which_fatal_errors_a_new_producer_recovers_from():
    """A fencing (another live instance owns the transactional id) and a refusal of the principal end
    the stage; other fatal errors (seen: an abort answered INVALID_TXN_STATE after the transaction
    coordinator moved to another broker) are recovered in-process by a new producer; a timeout is an
    unknown outcome (a new epoch, never a retry in the same one)."""
    from confluent_kafka import KafkaError

    from pipeline.errors import KafkaClientError
    from pipeline.kafka.common import recoverable_fatal, uncertain

    def err(code, **kw):
        return KafkaClientError("x", KafkaError(code, "x", **kw))

    assert recoverable_fatal(err(KafkaError.INVALID_TXN_STATE, fatal=True))
    assert not recoverable_fatal(err(KafkaError.INVALID_TXN_STATE))  # not fatal: an abort does
    for code in (KafkaError.PRODUCER_FENCED, KafkaError._FENCED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED):
        assert not recoverable_fatal(err(code, fatal=True))
    assert uncertain(err(KafkaError._TIMED_OUT, retriable=True))
    assert not uncertain(err(KafkaError._TIMED_OUT, txn_requires_abort=True))
    assert not uncertain(err(KafkaError.COORDINATOR_NOT_AVAILABLE, retriable=True))


def test_a_retired_producer_is_not_a_wedged_client(kafka_bootstrap):
    """A producer replaced after a timed-out or fatal transaction call is retired, not parked as
    wedged: a parked client makes every later worker run on a process's main thread end that
    process at its exit (``teardown_hazards``), which once ended a whole pytest session silently."""
    from pipeline.kafka import Producer, wedged_clients

    p = Producer({"bootstrap.servers": kafka_bootstrap})
    before = wedged_clients()
    p.retire()
    assert wedged_clients() == before and p.fatal and p.pending() == 0


def test_a_broker_handle_dropped_with_its_node_is_transient():
    """On a three-node cluster a restarted rollout worker's start-up read failed with
    _DESTROY_BROKER while a node was being killed (chaos --nodes 3) and the role exited as crashed;
    it is retried like a broker that is down. A client destroyed by its owner (_DESTROY) is not."""
    from pipeline.kafka.common import is_transient

    def err(code):
        return KafkaClientError("x", KafkaError(code, "x"))

    assert is_transient(err(KafkaError._DESTROY_BROKER)) and is_transient(err(KafkaError._TRANSPORT))
    assert not is_transient(err(KafkaError._DESTROY))


def test_a_failure_from_a_fenced_static_member_asks_for_a_new_consumer(stage):
    """The CI race of the reward worker's fencing test, made certain: a static member whose
    registration another consumer took has its transaction fail (FENCED_INSTANCE_ID on the offsets)
    and cannot seek back either (its client is in a fatal state). The rewind then says "fenced
    member" (``Consumer.is_fenced_member``), which the worker answers by replacing its consumer,
    instead of an erroneous-state error that ended it."""
    cfg, src, dst, group = stage
    static = {"group.instance.id": "m0", "session.timeout.ms": 10000}
    consumer = Consumer({**client_conf(cfg, "test", kind="consumer"), **static}, group_id=group)
    consumer.subscribe([src])
    loop = make_loop(cfg, consumer, f"{group}-tid", Events())
    intruder = Consumer({**client_conf(cfg, "intruder", kind="consumer"), **static}, group_id=group)
    try:
        batch = read_batch(consumer, 4)
        intruder.subscribe([src])
        deadline = time.monotonic() + 120
        while not (intruder.poll(0.2) is None and intruder.assignment()):
            assert time.monotonic() < deadline, "the intruder was never assigned"
        fenced = None
        while fenced is None:  # the member's next heartbeat finds its registration taken
            assert time.monotonic() < deadline, "the member was never fenced"
            try:
                consumer.poll(0.5)
            except ConsumeError as exc:
                fenced = exc
        assert Consumer.is_fenced_member(fenced), fenced
        with pytest.raises(ConsumeError) as info:
            loop.write(batch, copy_into(loop, dst, batch))
        assert Consumer.is_fenced_member(info.value), info.value
    finally:
        intruder.close()
        loop.close_committer(True)
        consumer.close()
        loop.close_producer(True)
    assert read_output(cfg, dst) == []  # the failed transaction left nothing visible
