"""The producer of the Kafka wrapper: idempotent (or transactional), no delivery error ever lost,
transaction calls bounded (``WedgedClient``). Part of the sealed Kafka wrapper (``pipeline.kafka``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka import Producer as _Producer

import schemas
from pipeline import codec
from pipeline.errors import DeliveryError
from pipeline.kafka.common import (
    _WEDGED,
    WedgedClient,
    _bounded,
    _kafka_error,
    _partitions_of,
    _raise_kafka,
    raise_if_auth_failed,
)
from pipeline.log import kv

if TYPE_CHECKING:
    from pipeline.kafka.consumer import Consumer

log = logging.getLogger(__name__)


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

    def _call(self, what: str, fn, *args, bound: float | None = None):
        """Call the client, mapping errors; with ``bound``, a call still blocked after ``bound``
        seconds parks this client for good and raises WedgedClient (the caller builds a new one)."""
        try:
            return _bounded(fn, args, bound, what) if bound else fn(*args)
        except WedgedClient:
            self.fatal = True
            if self._client is not None:
                _WEDGED.append(self._client)
                self._client = None
            raise
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
    # Each call is bounded by its own timeout plus TXN_GRACE_S: librdkafka can block in them forever
    # (its coordinator request timeout is never checked, #5456); then WedgedClient.
    TXN_GRACE_S = 15.0

    def init_transactions(self, timeout: float = 60.0) -> None:
        self._call("init_transactions", self._c().init_transactions, timeout, bound=timeout + self.TXN_GRACE_S)

    def begin_transaction(self) -> None:
        self._raise_pending()
        self._call("begin_transaction", self._c().begin_transaction)

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], consumer: Consumer, timeout=30.0):
        """Add ``consumer``'s ``offsets`` to the open transaction (WedgedClient if librdkafka blocks)."""
        meta = consumer.group_metadata()
        fn = self._c().send_offsets_to_transaction
        self._call("send_offsets_to_transaction", fn, offsets, meta, timeout, bound=timeout + self.TXN_GRACE_S)

    def commit_transaction(self, timeout: float = 60.0) -> None:
        self._call("commit_transaction", self._c().commit_transaction, timeout, bound=timeout + self.TXN_GRACE_S)
        self._raise_pending()

    def abort_transaction(self, timeout: float = 60.0) -> None:
        self._call("abort_transaction", self._c().abort_transaction, timeout, bound=timeout + self.TXN_GRACE_S)
        self._error = None  # aborted messages are not delivered by design

    def close(self, timeout: float = 30.0) -> None:
        """Flush what is queued. Raises DeliveryError if anything was lost."""
        if self._client is not None:
            try:
                if not self.fatal:  # a fatal (fenced) client cannot flush; what it held is aborted anyway
                    self.flush(timeout)
            finally:
                self._client = None

    def discard(self) -> int:
        """Drop every message not acknowledged yet (queued or in flight) and release the client
        without flushing: for a stop that leaves them to be produced again by whoever owns their
        input next (its offsets stay uncommitted), e.g. while the broker is away. Their delivery
        callbacks see the purge error, which is not raised. A message in flight may have been
        written all the same (at-least-once). Returns how many were dropped."""
        if self._client is None:
            return 0
        client, self._client = self._client, None
        dropped = len(client)
        try:
            client.purge()
            client.poll(0)  # serve the purged messages' delivery reports
        except KafkaException as exc:
            log.warning("purging the producer's queue failed %s", kv(error=exc, queued=dropped))
        self._error = None
        return dropped

    def retire(self) -> None:
        """Stop using this client for good and let it go on a daemon thread: its destruction (which
        may block a while after a transaction call timed out) never holds up the caller, and at
        exit nothing waits for it. Its requests still in flight are fenced by its successor's epoch.
        Not a wedged client (``WedgedClient``): a process that retired one still ends normally."""
        client, self._client = self._client, None
        self.fatal = True
        if client is None:
            return
        held = [client]
        del client

        def let_go() -> None:
            held.clear()  # the last reference: librdkafka's destroy runs on this thread

        threading.Thread(target=let_go, name="kafka-retire", daemon=True).start()

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
