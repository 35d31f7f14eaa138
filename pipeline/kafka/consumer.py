"""The consumer of the Kafka wrapper: manual commits, typed errors, transient errors ridden out,
pause flags cleared on assignment, a cached assignment, ``read_to_end``. Part of the sealed Kafka
wrapper (``pipeline.kafka``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from confluent_kafka import Consumer as _Consumer
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from pipeline.errors import ConsumeError
from pipeline.kafka.common import (
    _TRANSIENT_CODES,
    _UNKNOWN_TOPIC_CODES,
    ASSIGN_ONLY_GROUP_PREFIX,
    TP,
    _partitions_of,
    _raise_kafka,
    _tp,
    raise_if_auth_failed,
    retry_transient,
)
from pipeline.log import kv

log = logging.getLogger(__name__)


FETCH_QUEUE_BACKOFF_MS = 20
"""librdkafka postpones a partition's next fetch by ``fetch.queue.backoff.ms`` (default 1000) once
its local queue is over ``queued.max.messages.kbytes`` (64 MB). With 64 MB fetches, a consumer
reading a backlog (a restarted trainer, the transport bench) then waited about 0.9 s each time it
drained its queue: 11,300 against 80,000-96,000 messages/s of 10 KB, eight runs each
(docs/results/performance.md, transport). 20 ms only re-checks the queue more often."""
FETCH_DEFAULTS = {
    "fetch.max.bytes": 64 * 1024 * 1024,
    "max.partition.fetch.bytes": 16 * 1024 * 1024,
    "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
}
"""How rlstream's consumers fetch (and the benchmarks' raw references, for a like comparison)."""
CLASSIC_ONLY = ("partition.assignment.strategy", "session.timeout.ms", "heartbeat.interval.ms")
"""Settings of the classic group protocol that librdkafka refuses with ``group.protocol=consumer``
(KIP-848: the broker assigns, incrementally, and sets the session timeout and heartbeat interval,
``group.consumer.*`` on the broker). With that protocol (``kafka.consumer``) they are left out."""


class Consumer:
    """Consumer with manual commits; ``poll``/``consume`` turn ``msg.error()`` into ConsumeError
    (fatal and non-transient errors) or a log line (transient ones, which librdkafka recovers).

    ``isolation.level`` defaults to read_committed so transactional output (rl.scored) is seen
    only once committed. Partition EOF events are swallowed unless ``enable.partition.eof`` is
    set, in which case ``poll`` returns them and ``is_eof(msg)`` tells.
    """

    def __init__(self, conf: dict, group_id: str | None = None):
        self._conf = {
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "partition.assignment.strategy": "cooperative-sticky",
            **FETCH_DEFAULTS,
            **conf,
        }
        self.kip848 = str(self._conf.get("group.protocol", "classic")).lower() == "consumer"
        if self.kip848:
            dropped = {k: self._conf.pop(k) for k in CLASSIC_ONLY if k in self._conf}
            log.debug("group.protocol=consumer: leaving out classic-only settings %s", kv(**dropped))
        if group_id:
            self._conf["group.id"] = group_id
        elif "group.id" not in self._conf:
            # librdkafka needs a group id even for assign()-only use; it is never committed to.
            self._conf["group.id"] = f"{ASSIGN_ONLY_GROUP_PREFIX}{id(self)}"
        self._client: _Consumer | None = None
        self._subscription: tuple | None = None
        """What ``subscribe`` was given, for ``renew``."""
        self._assigned: set[TP] = set()
        self._paused: set[TP] = set()
        self._last_transient = 0.0

    def _c(self) -> _Consumer:
        if self._client is None:
            self._client = _Consumer(self._conf)
        return self._client

    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except KafkaException as exc:
            _raise_kafka(exc, what, ConsumeError)

    # -- assignment ----------------------------------------------------------------------------
    def subscribe(self, topics: Iterable[str], on_assign=None, on_revoke=None, on_lost=None):
        """Join the group. Callbacks get ``(consumer, [TopicPartition])`` as in confluent-kafka;
        they run inside ``poll``/``consume``/``close``."""

        self._subscription = (list(topics), on_assign, on_revoke, on_lost)
        cooperative = self.kip848 or "cooperative" in str(self._conf.get("partition.assignment.strategy", ""))

        def assigned(client, parts):
            self._check_assigned_topics(parts)
            tps = {(p.topic, p.partition) for p in parts}
            (client.incremental_assign if cooperative else client.assign)(parts)
            if parts:  # clear a pause flag left from an earlier ownership (see module docstring)
                client.resume([TopicPartition(t, p) for t, p in tps])
            self._paused -= tps
            self._assigned |= tps
            if on_assign:
                on_assign(self, parts)

        def removed(user_cb):
            def cb(client, parts):
                try:
                    if user_cb:
                        user_cb(self, parts)
                finally:
                    tps = {(p.topic, p.partition) for p in parts}
                    self._assigned -= tps
                    self._paused -= tps

            return cb

        self._call(
            "subscribe",
            self._c().subscribe,
            list(topics),
            on_assign=assigned,
            on_revoke=removed(on_revoke),
            on_lost=removed(on_lost),
        )

    def _check_assigned_topics(self, parts) -> None:
        """An assignment may only hold topics of the subscription. A static member
        (``group.instance.id``) that rejoins its group within the session timeout is handed back
        the assignment it had, whatever it subscribes to now: a consumer that last joined with other
        topics (another job with this consumer group and instance id, or this job's topics renamed)
        would read those topics' committed ends and never see its own records, alive and idle.
        Raised instead, inside ``poll``/``consume``: the role exits non-zero with this message."""
        topics = self._subscription[0]
        if any(t.startswith("^") for t in topics):  # a pattern subscription: any matching topic
            return
        foreign = sorted({p.topic for p in parts} - set(topics))
        if foreign:
            iid = self._conf.get("group.instance.id")
            raise ConsumeError(
                f"consumer group {self._conf['group.id']!r} assigned this consumer partitions of {foreign}, topics it "
                f"does not subscribe to ({topics}): the static member {iid!r} last joined this group with other "
                "topics and the broker handed its old assignment back. Another job uses this consumer group and "
                "instance id, or this job's topics changed: give each job its own consumer group (the stage's "
                "group_id; `rlstream run` names them after the job). The old registration ends session.timeout.ms "
                "after its last member left; a restart after that joins afresh."
            )

    def renew(self) -> None:
        """Replace the client by a new one with the same settings and subscription, in place (the
        objects holding this wrapper keep it): the way out of a fatal consumer error such as a
        static member fenced by its own instance id (``is_fenced_member``). The old client is
        closed (its final revoke or loss callbacks run; a failing close is logged, not raised);
        the new one joins the group as a new member with the same ``group.instance.id``, taking the
        registration back, and reads on from the group's committed offsets."""
        if self._subscription is None:
            raise RuntimeError("renew() needs a subscribed consumer")
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except (KafkaException, RuntimeError) as exc:  # a fatally failed client may refuse to close cleanly
                log.warning("closing the replaced consumer failed %s", kv(error=exc))
        self._assigned.clear()
        self._paused.clear()
        topics, on_assign, on_revoke, on_lost = self._subscription
        self.subscribe(topics, on_assign=on_assign, on_revoke=on_revoke, on_lost=on_lost)

    def assign(self, partitions: list[TopicPartition]) -> None:
        """Read these partitions (from each one's offset, if set) outside any group rebalance."""
        self._call("assign", self._c().assign, [_tp(p) for p in partitions])
        self._assigned = {(p.topic, p.partition) for p in map(_tp, partitions)}
        self._paused.clear()

    def unassign(self) -> None:
        if self._client is not None:
            self._call("unassign", self._client.unassign)
        self._assigned.clear()
        self._paused.clear()

    def assignment(self) -> set[TP]:
        """Partitions currently owned, as ``(topic, partition)`` (cached; no client call)."""
        return set(self._assigned)

    def pause(self, tps: Iterable[TP]) -> None:
        tps = set(tps) & self._assigned
        if tps:
            self._call("pause", self._c().pause, [TopicPartition(t, p) for t, p in tps])
            self._paused |= tps

    def resume(self, tps: Iterable[TP]) -> None:
        tps = set(tps) & self._assigned
        if tps:
            self._call("resume", self._c().resume, [TopicPartition(t, p) for t, p in tps])
            self._paused -= tps

    def paused(self) -> set[TP]:
        return set(self._paused)

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self._call("seek", self._c().seek, TopicPartition(topic, partition, offset))

    def position(self, tps: Iterable[TP]) -> dict[TP, int]:
        """Next offset to read per partition (negative while unknown)."""
        res = self._call("position", self._c().position, [TopicPartition(t, p) for t, p in tps])
        return {(r.topic, r.partition): r.offset for r in res}

    def committed(self, tps: Iterable[TP], timeout: float = 30.0) -> dict[TP, int]:
        """The group's committed offsets (negative where none)."""
        res = self._call("committed", self._c().committed, [TopicPartition(t, p) for t, p in tps], timeout=timeout)
        return {(r.topic, r.partition): r.offset for r in res}

    def watermarks(self, topic: str, partition: int, timeout: float = 30.0) -> tuple[int, int]:
        """(low, high) offsets, retrying while a fresh topic's leader is not known yet."""
        fn, tp = self._c().get_watermark_offsets, TopicPartition(topic, partition)

        def once():
            try:
                return self._call("watermarks", fn, tp, timeout=min(10.0, timeout))
            except ConsumeError as exc:
                if exc.kafka_error is not None and exc.kafka_error.code() in _UNKNOWN_TOPIC_CODES:
                    _partitions_of(
                        self._c(), topic, min(10.0, timeout)
                    )  # the real reason: not there yet, or not allowed
                raise

        return retry_transient(once, timeout, f"watermarks {topic}")

    def partitions(self, topic: str, timeout: float = 30.0) -> list[int]:
        """Partition ids of ``topic``; KafkaClientError if it does not exist."""
        return _partitions_of(self._c(), topic, timeout)

    def read_to_end(
        self, topic: str, start: dict[int, int] | None = None, timeout: float = 60.0, strict: bool = True
    ) -> list[Message]:
        """Every message of ``topic`` from ``start`` (partition -> offset; default the log start) up to
        the end offsets of the moment of the call, then unassign. Transaction markers and aborted
        records are skipped by position. Past ``timeout``: TimeoutError, or (``strict=False``) what
        was read so far."""
        ends, todo = {}, []
        for p in self.partitions(topic, timeout):
            lo, hi = self.watermarks(topic, p, timeout)
            first = max(lo, (start or {}).get(p, lo))
            if hi > first:
                ends[p] = hi
                todo.append(TopicPartition(topic, p, first))
        out: list[Message] = []
        if not todo:
            return out
        self.assign(todo)
        deadline = time.monotonic() + timeout
        try:
            while ends:
                if time.monotonic() > deadline:
                    if strict:
                        raise TimeoutError(f"could not read {topic} to its end within {timeout} s ({ends})")
                    break
                out.extend(m for m in self.consume(1000, 0.5) if m.offset() < ends.get(m.partition(), -1))
                for (_, p), pos in self.position([(topic, p) for p in ends]).items():
                    if pos >= ends[p]:
                        del ends[p]
        finally:
            self.unassign()
        return out

    def group_metadata(self):
        """The consumer's group metadata, for ``Producer.send_offsets_to_transaction``."""
        return self._call("consumer_group_metadata", self._c().consumer_group_metadata)

    # -- reading -------------------------------------------------------------------------------
    @staticmethod
    def is_fenced_member(exc: BaseException) -> bool:
        """``exc`` says this consumer, a static member, was fenced by a consumer with the same
        ``group.instance.id`` (a fatal error of the client: ``renew`` is the way on, or exit). A
        consumer's fatal error reaches ``poll`` as code ``_FATAL`` (whose ``fatal()`` is false)
        naming the cause in its text."""
        if not isinstance(exc, ConsumeError) or exc.kafka_error is None:
            return False
        err = exc.kafka_error
        return err.code() == KafkaError.FENCED_INSTANCE_ID or (
            (err.fatal() or err.code() == KafkaError._FATAL) and "same group.instance.id" in (err.str() or "")
        )

    @staticmethod
    def is_eof(msg: Message) -> bool:
        return msg.error() is not None and msg.error().code() == KafkaError._PARTITION_EOF

    def _check(self, msg: Message | None) -> Message | None:
        if msg is None:
            return None
        err = msg.error()
        if err is None:
            return msg
        if err.code() == KafkaError._PARTITION_EOF:
            return msg if self._conf.get("enable.partition.eof") else None
        if not err.fatal() and (err.retriable() or err.code() in _TRANSIENT_CODES - _UNKNOWN_TOPIC_CODES):
            raise_if_auth_failed(f"consume from {msg.topic()}")
            now = time.monotonic()
            if now - self._last_transient > 10:  # librdkafka reconnects by itself; say so now and then
                log.warning("kafka unavailable, riding it out %s", kv(error=err))
                self._last_transient = now
            return None
        raise ConsumeError(f"consume error: {err} ({kv(topic=msg.topic(), partition=msg.partition())})", err)

    def poll(self, timeout: float = 1.0) -> Message | None:
        return self._check(self._call("poll", self._c().poll, timeout))

    def consume(self, num: int = 500, timeout: float = 1.0) -> list[Message]:
        out = []
        for m in self._call("consume", self._c().consume, num, timeout):
            m = self._check(m)
            if m is not None:
                out.append(m)
        return out

    def commit(self, offsets: list[TopicPartition] | None = None, asynchronous: bool = False) -> None:
        """Commit ``offsets`` (or the current positions). ``asynchronous`` returns at once; a
        failure then reaches the ``on_commit`` callback given in the config."""
        kw = {"asynchronous": asynchronous}
        if offsets is not None:
            kw["offsets"] = [_tp(o) for o in offsets]
        self._call("commit", self._c().commit, **kw)

    def close(self) -> None:
        """Leave the group (a final revoke runs) and destroy the client."""
        if self._client is not None:
            client, self._client = self._client, None
            try:
                client.close()
            except KafkaException as exc:
                _raise_kafka(exc, "close", ConsumeError)
            finally:
                self._assigned.clear()
                self._paused.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
