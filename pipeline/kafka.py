"""The Kafka wrapper: the only module (with ``pipeline.admin``) that touches confluent-kafka's clients.

A producer that never loses a delivery error, a consumer with manual commits, and the client
settings every role shares. Each client is created lazily and kept private; every call a worker
needs (assignment, pause/resume, seek, position, watermarks, commits, group metadata,
transactions) is a method here that maps ``KafkaException`` to the typed hierarchy of
``pipeline.errors`` and bounds its wait.

Liveness rules kept here, once for every role:
* transient errors (broker unreachable, leader elections, metadata not ready, coordinator
  loading) reported by ``poll``/``consume`` are logged and ridden out, not raised: librdkafka
  reconnects by itself; fatal errors raise;
* a newly assigned partition is resumed before the caller sees it: librdkafka keeps a pause flag
  across revoke and re-assign, and a partition handed back paused would never be fetched again;
* the assignment is cached from the rebalance callbacks, so asking for it costs nothing;
* ``retry_transient`` retries start-up calls with backoff until a deadline.

What this is not: a stream-processing framework. Workers keep their own loops.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka import Consumer as _Consumer
from confluent_kafka import Producer as _Producer

import schemas
from pipeline import codec
from pipeline.errors import ConsumeError, DecodeError, DeliveryError, KafkaClientError, TopicError
from pipeline.log import kv

__all__ = [
    "DEFAULT_BOOTSTRAP",
    "OFFSET_BEGINNING",
    "Consumer",
    "Message",
    "Producer",
    "TopicPartition",
    "client_conf",
    "decode_message",
    "is_transient",
    "next_offsets",
    "retry_transient",
    "wait_for",
]

log = logging.getLogger(__name__)
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
ASSIGN_ONLY_GROUP_PREFIX = "rlstream-nogroup-"
"""Group id prefix of assign-only consumers (never committed to; librdkafka still looks it up, so a
secured cluster grants Describe on this prefix: docs/security.md)."""
TP = tuple[str, int]
_auth_error: list = []
"""The newest authentication/TLS failure librdkafka reported (its error callback), if any."""


def _on_client_error(err: KafkaError) -> None:
    """librdkafka's error callback: remember authentication and TLS failures (librdkafka itself only
    retries them, so start-up would wait out its deadline on a wrong password) and log the rest."""
    if err.code() in _AUTH_CODES:
        _auth_error[:] = [err]
        log.error("kafka authentication failed %s", kv(error=err))
    elif err.fatal():
        log.error("kafka client error %s", kv(error=err))


def raise_if_auth_failed(what: str = "") -> None:
    """Raise KafkaClientError if a client of this process failed to authenticate."""
    if _auth_error:
        err = _auth_error[0]
        raise KafkaClientError(f"{what + ': ' if what else ''}authentication failed: {err} (check kafka.common: "
                               "security.protocol, sasl.*, ssl.ca.location; docs/security.md)", err)  # fmt: skip


def client_conf(cfg, role: str, worker_id: str | None = None, kind: str = "common") -> dict:
    """librdkafka settings for one client of ``role``. ``cfg`` is the root config; its
    ``kafka.bootstrap_servers`` was resolved at start-up by the application layer."""
    wid = worker_id or f"{socket.gethostname()}-{os.getpid()}"
    conf: dict = {
        "bootstrap.servers": cfg.kafka.bootstrap_servers or DEFAULT_BOOTSTRAP,
        "client.id": f"{cfg.kafka.client_id_prefix}-{role}-{wid}",
        "log_level": 5,  # librdkafka: notice and above (info is chatty about internal queues)
        "error_cb": _on_client_error,
    }
    conf.update(cfg.kafka.common)
    if kind == "producer":
        conf.update(cfg.kafka.producer)
    elif kind == "consumer":
        conf.update(cfg.kafka.consumer)
    return conf


# ---- errors --------------------------------------------------------------------------------
_TRANSIENT_CODES = {
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError._RESOLVE,
    KafkaError._WAIT_COORD,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
}
_UNKNOWN_TOPIC_CODES = {KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION}
_AUTH_CODES = {KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.SASL_AUTHENTICATION_FAILED}
_AUTHZ_CODES = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
}


def _kafka_error(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    err = getattr(exc, "kafka_error", None)
    return err if isinstance(err, KafkaError) else None


def is_transient(exc: BaseException) -> bool:
    """True for errors that go away by themselves: retriable ones, leader elections, a broker that
    is unreachable for now, metadata or a coordinator not ready yet."""
    err = _kafka_error(exc)
    if err is None:
        return False
    return not err.fatal() and (err.retriable() or err.code() in _TRANSIENT_CODES)


def retry_transient(fn: Callable, timeout: float = 30.0, what: str = "", interval: float = 0.2):
    """Call ``fn()`` until it returns, retrying transient Kafka errors with exponential backoff
    (``interval`` doubling up to 5 s) until ``timeout``; then the last error is raised."""
    deadline = time.monotonic() + timeout
    delay, last_note = interval, 0.0
    while True:
        try:
            return fn()
        except (KafkaException, KafkaClientError) as exc:
            raise_if_auth_failed(what)
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            now = time.monotonic()
            if now - last_note > 10:
                err = _kafka_error(exc)
                hint = (
                    " (run `rlstream topics create`?)" if err is not None and err.code() in _UNKNOWN_TOPIC_CODES else ""
                )
                log.warning("waiting for Kafka%s %s", hint, kv(what=what or getattr(fn, "__name__", "call"), error=err))
                last_note = now
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _raise_kafka(exc: KafkaException, what: str, cls=KafkaClientError):
    err = _kafka_error(exc)
    raise cls(f"{what}: {err or exc}", err) from exc


def _tp(t) -> TopicPartition:
    return t if isinstance(t, TopicPartition) else TopicPartition(t[0], t[1], *t[2:])


def _partitions_of(client, topic: str, timeout: float) -> list[int]:
    try:
        meta = client.list_topics(topic, timeout=timeout).topics.get(topic)
    except KafkaException as exc:
        _raise_kafka(exc, f"metadata of {topic}")
    if meta is None or meta.error is not None or not meta.partitions:
        code = meta.error if meta is not None and meta.error is not None else KafkaError(KafkaError._UNKNOWN_TOPIC)
        if code.code() in _AUTHZ_CODES:
            raise TopicError(
                f"not authorized for topic {topic} ({code}): grant this principal ACLs (docs/security.md)", code
            )
        raise TopicError(f"topic {topic} is not available ({code}); run `rlstream topics create`", code)
    return sorted(meta.partitions)


# ---- producer ------------------------------------------------------------------------------
class Producer:
    """Idempotent producer (acks=all) by default; transactional when given a transactional id.

    The first failed delivery is kept and raised as DeliveryError on the next ``produce`` or
    ``flush``; later failures are counted, never dropped silently.
    """

    def __init__(self, conf: dict, *, transactional_id: str | None = None, idempotent: bool = True):
        self._conf = {
            "enable.idempotence": idempotent,
            "acks": "all",
            "linger.ms": 5,
            "message.max.bytes": 16 * 1024 * 1024,
            # Same key -> partition mapping as the Java client and Kafka's own tools.
            "partitioner": "murmur2_random",
            **conf,
        }
        if transactional_id:
            self._conf["transactional.id"] = transactional_id
            self._conf["enable.idempotence"] = True
        self._client: _Producer | None = None
        self._error: DeliveryError | None = None
        self.failed = 0
        self.delivered = 0
        self.fatal = False  # set once the client reported a fatal error (e.g. fenced); close() then skips flush

    def _c(self) -> _Producer:
        if self._client is None:
            self._client = _Producer(self._conf)
        return self._client

    def _on_delivery(self, err, msg, user_cb=None):
        if err is not None:
            self.failed += 1
            if err.fatal():
                self.fatal = True
            if self._error is None:
                self._error = DeliveryError(
                    f"delivery to {msg.topic()} failed: {err} ({kv(partition=msg.partition())})", err
                )
        else:
            self.delivered += 1
        if user_cb is not None:
            user_cb(err, msg)

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is not None and err.fatal():
                self.fatal = True
            _raise_kafka(exc, what)

    def _raise_pending(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None = None,
        headers: dict | list | None = None,
        partition: int | None = None,
        on_delivery: Callable | None = None,
    ) -> None:
        self._raise_pending()
        kwargs = {"value": value, "key": key, "headers": headers}
        if partition is not None:
            kwargs["partition"] = partition
        cb = (lambda e, m: self._on_delivery(e, m, on_delivery)) if on_delivery else self._on_delivery
        client = self._c()
        while True:
            try:
                client.produce(topic, on_delivery=cb, **kwargs)
                break
            except BufferError:  # local queue full (e.g. the broker is away): serve reports, retry
                client.poll(0.05)
                self._raise_pending()
            except KafkaException as exc:
                _raise_kafka(exc, f"produce to {topic}")
        client.poll(0)

    def produce_record(self, topic: str, schema: str, record: dict, key=None, **kw) -> None:
        """Encode ``record`` with the Avro codec and produce it."""
        value = codec.encode(schema, record, ctx=f"topic {topic}")
        headers = {codec.SCHEMA_HEADER: schemas.latest(schema).label.encode()}
        headers.update(kw.pop("headers", None) or {})
        self.produce(topic, value, key=key, headers=headers, **kw)

    def poll(self, timeout: float = 0) -> int:
        n = self._client.poll(timeout) if self._client is not None else 0
        self._raise_pending()
        return n

    def pending(self) -> int:
        """Messages produced and not yet acknowledged (or failed)."""
        return len(self._client) if self._client is not None else 0

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued message is acknowledged; DeliveryError if one failed or if some
        are still queued after ``timeout``."""
        if self._client is None:
            self._raise_pending()
            return
        remaining = self._client.flush(timeout)
        self._raise_pending()
        if remaining:
            raise DeliveryError(f"{remaining} message(s) still undelivered after flush({timeout}s)")

    def flush_patiently(self, timeout: float, what: str = "flush") -> None:
        """``flush`` that rides out a broker outage: waits up to ``timeout`` (librdkafka keeps the
        messages and retries), logging while it waits."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.flush(min(10.0, max(0.1, deadline - time.monotonic())))
            except DeliveryError as exc:
                raise_if_auth_failed(what)
                if exc.kafka_error is not None or time.monotonic() >= deadline:
                    raise
                log.warning("waiting for the broker to acknowledge %s", kv(what=what, queued=self.pending()))

    def partitions(self, topic: str, timeout: float = 30.0) -> list[int]:
        """Partition ids of ``topic``; KafkaClientError if it does not exist."""
        return _partitions_of(self._c(), topic, timeout)

    # transactions -----------------------------------------------------------------------
    def init_transactions(self, timeout: float = 60.0) -> None:
        self._call("init_transactions", self._c().init_transactions, timeout)

    def begin_transaction(self) -> None:
        self._raise_pending()
        self._call("begin_transaction", self._c().begin_transaction)

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], consumer: Consumer, timeout=30.0):
        """Add ``consumer``'s ``offsets`` to the open transaction. librdkafka may block here past
        ``timeout`` after a broker restart: callers guard it with a watchdog (pipeline.worker)."""
        meta = consumer.group_metadata()
        self._call("send_offsets_to_transaction", self._c().send_offsets_to_transaction, offsets, meta, timeout)

    def commit_transaction(self, timeout: float = 60.0) -> None:
        self._call("commit_transaction", self._c().commit_transaction, timeout)
        self._raise_pending()

    def abort_transaction(self, timeout: float = 60.0) -> None:
        self._call("abort_transaction", self._c().abort_transaction, timeout)
        self._error = None  # aborted messages are not delivered by design

    def close(self, timeout: float = 30.0) -> None:
        """Flush what is queued. Raises DeliveryError if anything was lost."""
        if self._client is not None:
            try:
                if not self.fatal:  # a fatal (fenced) client cannot flush; what it held is aborted anyway
                    self.flush(timeout)
            finally:
                self._client = None

    def abandon(self) -> None:
        """Release the client without flushing. Only for a producer whose open transaction is lost
        anyway (fenced, or failing): tracebacks may keep this wrapper alive, not the client."""
        self._client = None

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.close()
        elif self._client is not None:
            if not self.fatal:
                self._client.flush(5)
            self._client = None


# ---- consumer ------------------------------------------------------------------------------
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
            "fetch.max.bytes": 64 * 1024 * 1024,
            "max.partition.fetch.bytes": 16 * 1024 * 1024,
            **conf,
        }
        if group_id:
            self._conf["group.id"] = group_id
        elif "group.id" not in self._conf:
            # librdkafka needs a group id even for assign()-only use; it is never committed to.
            self._conf["group.id"] = f"{ASSIGN_ONLY_GROUP_PREFIX}{id(self)}"
        self._client: _Consumer | None = None
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

        cooperative = "cooperative" in str(self._conf.get("partition.assignment.strategy", ""))

        def assigned(client, parts):
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


def decode_message(msg: Message, expected: str | None = None) -> dict:
    """Decode a consumed message's value; DecodeError names topic, partition and offset."""
    try:
        return codec.decode(msg.value(), expected)[1]
    except DecodeError as exc:
        raise exc.located(msg.topic(), msg.partition(), msg.offset()) from exc


def next_offsets(messages: Iterable[Message]) -> list[TopicPartition]:
    """Offsets to commit after ``messages``: last offset + 1 per topic/partition."""
    last: dict[tuple[str, int], int] = {}
    for m in messages:
        key = (m.topic(), m.partition())
        last[key] = max(last.get(key, -1), m.offset())
    return [TopicPartition(t, p, o + 1) for (t, p), o in sorted(last.items())]


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
