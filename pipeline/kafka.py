"""Thin wrappers over confluent-kafka: a producer that never loses a delivery error, a consumer
with manual commits and typed errors, and the client settings every role shares.

What this is not: a stream-processing framework. Workers keep their own loops; these classes
only make the sharp edges of the client safe (lazy creation, first-error re-raise, flush on
close, ``msg.error()`` as exceptions).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from confluent_kafka import Consumer as _Consumer
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka import Producer as _Producer

import schemas
from pipeline import codec
from pipeline.errors import ConsumeError, DecodeError, DeliveryError, KafkaClientError
from pipeline.log import kv

log = logging.getLogger(__name__)
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def resolve_bootstrap(kafka_cfg, broker_cfg=None) -> str:
    """The configured bootstrap servers, else the running local broker's, else the default."""
    if kafka_cfg.bootstrap_servers:
        return kafka_cfg.bootstrap_servers
    if broker_cfg is not None:
        from pipeline.broker import read_state

        state = read_state(Path(broker_cfg.data_dir))
        if state and state.get("bootstrap"):
            return state["bootstrap"]
    return DEFAULT_BOOTSTRAP


def client_conf(cfg, role: str, worker_id: str | None = None, kind: str = "common") -> dict:
    """librdkafka settings for one client of ``role``. ``cfg`` is the root Config."""
    wid = worker_id or f"{socket.gethostname()}-{os.getpid()}"
    conf: dict = {
        "bootstrap.servers": resolve_bootstrap(cfg.kafka, cfg.broker),
        "client.id": f"{cfg.kafka.client_id_prefix}-{role}-{wid}",
        "log_level": 5,  # librdkafka: notice and above (info is chatty about internal queues)
    }
    conf.update(cfg.kafka.common)
    if kind == "producer":
        conf.update(cfg.kafka.producer)
    elif kind == "consumer":
        conf.update(cfg.kafka.consumer)
    return conf


_LEADER_CODES = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError._TRANSPORT}


def is_transient(exc: BaseException) -> bool:
    """True for errors that go away by themselves: retriable ones, and leader elections (which
    librdkafka does not always flag retriable on metadata and offset queries)."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else getattr(exc, "kafka_error", None)
    return isinstance(err, KafkaError) and (err.retriable() or err.code() in _LEADER_CODES)


def retry_transient(fn: Callable, timeout: float = 30.0, interval: float = 0.2):
    """Call ``fn()`` until it returns, retrying transient Kafka errors until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except KafkaException as exc:
            if not is_transient(exc) or time.monotonic() > deadline:
                raise
            time.sleep(interval)


def _raise_kafka(exc: KafkaException, what: str, cls=KafkaClientError):
    err = exc.args[0] if exc.args else None
    raise cls(f"{what}: {err}", err if isinstance(err, KafkaError) else None) from exc


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

    @property
    def client(self) -> _Producer:
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

    def _note_fatal(self, exc: KafkaException) -> None:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.fatal():
            self.fatal = True

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
        while True:
            try:
                self.client.produce(topic, on_delivery=cb, **kwargs)
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self.client.poll(0.05)
            except KafkaException as exc:
                _raise_kafka(exc, f"produce to {topic}")
        self.client.poll(0)

    def produce_record(self, topic: str, schema: str, record: dict, key=None, **kw) -> None:
        """Encode ``record`` with the Avro codec and produce it."""
        value = codec.encode(schema, record, ctx=f"topic {topic}")
        headers = {codec.SCHEMA_HEADER: schemas.latest(schema).label.encode()}
        headers.update(kw.pop("headers", None) or {})
        self.produce(topic, value, key=key, headers=headers, **kw)

    def poll(self, timeout: float = 0) -> int:
        n = self.client.poll(timeout) if self._client is not None else 0
        self._raise_pending()
        return n

    def flush(self, timeout: float = 30.0) -> None:
        if self._client is None:
            self._raise_pending()
            return
        remaining = self._client.flush(timeout)
        self._raise_pending()
        if remaining:
            raise DeliveryError(f"{remaining} message(s) still undelivered after flush({timeout}s)")

    # transactions -----------------------------------------------------------------------
    def init_transactions(self, timeout: float = 60.0) -> None:
        try:
            self.client.init_transactions(timeout)
        except KafkaException as exc:
            self._note_fatal(exc)
            _raise_kafka(exc, "init_transactions")

    def begin_transaction(self) -> None:
        self._raise_pending()
        try:
            self.client.begin_transaction()
        except KafkaException as exc:
            self._note_fatal(exc)
            _raise_kafka(exc, "begin_transaction")

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], group_metadata, timeout=30.0):
        try:
            self.client.send_offsets_to_transaction(offsets, group_metadata, timeout)
        except KafkaException as exc:
            self._note_fatal(exc)
            _raise_kafka(exc, "send_offsets_to_transaction")

    def commit_transaction(self, timeout: float = 60.0) -> None:
        try:
            self.client.commit_transaction(timeout)
        except KafkaException as exc:
            self._note_fatal(exc)
            _raise_kafka(exc, "commit_transaction")
        self._raise_pending()

    def abort_transaction(self, timeout: float = 60.0) -> None:
        try:
            self.client.abort_transaction(timeout)
        except KafkaException as exc:
            self._note_fatal(exc)
            _raise_kafka(exc, "abort_transaction")
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


class Consumer:
    """Consumer with manual commits; ``poll`` turns ``msg.error()`` into ConsumeError.

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
            self._conf["group.id"] = f"rlstream-nogroup-{id(self)}"
        self._client: _Consumer | None = None

    @property
    def client(self) -> _Consumer:
        if self._client is None:
            self._client = _Consumer(self._conf)
        return self._client

    def subscribe(self, topics: Iterable[str], on_assign=None, on_revoke=None, on_lost=None):
        kw = {}
        if on_assign:
            kw["on_assign"] = on_assign
        if on_revoke:
            kw["on_revoke"] = on_revoke
        if on_lost:
            kw["on_lost"] = on_lost
        self.client.subscribe(list(topics), **kw)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.client.assign(partitions)

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
        raise ConsumeError(f"consume error: {err} ({kv(topic=msg.topic(), partition=msg.partition())})", err)

    def poll(self, timeout: float = 1.0) -> Message | None:
        return self._check(self.client.poll(timeout))

    def consume(self, num: int = 500, timeout: float = 1.0) -> list[Message]:
        out = []
        for m in self.client.consume(num, timeout):
            m = self._check(m)
            if m is not None:
                out.append(m)
        return out

    def commit(self, offsets: list[TopicPartition] | None = None, message: Message | None = None):
        try:
            if offsets is not None:
                return self.client.commit(offsets=offsets, asynchronous=False)
            if message is not None:
                return self.client.commit(message=message, asynchronous=False)
            return self.client.commit(asynchronous=False)
        except KafkaException as exc:
            _raise_kafka(exc, "commit", ConsumeError)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

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
