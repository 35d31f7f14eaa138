"""The Kafka wrapper: the only package (with ``pipeline.admin``) that touches confluent-kafka's clients
(``common``: settings, errors, retries, bounded calls; ``producer``; ``consumer``; ``txn``: the
exactly-once read-process-write loop).

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
* ``check_reachable`` is the one bounded "does a broker answer?" check of commands run by hand;
* ``retry_transient`` retries start-up calls with backoff until a deadline; authentication and
  authorization failures end them at once, with what to fix;
* transaction calls are bounded: one that librdkafka never returns from (#5456, after a broker
  restart) raises ``WedgedClient`` and the stuck client is parked, so the caller can go on with a
  new one instead of hanging;
* the exactly-once protocol (``ExactlyOnceLoop``: begin, produce, offsets into the transaction,
  commit with bounded retries, abort and rewind, wedged-producer replacement, the optional commit
  thread) is written once, here; a stage says what to produce and never calls a transaction
  method itself.

What this is not: a stream-processing framework. Workers keep their own loops.
"""

from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_LOG_APPEND_TIME, Message, TopicPartition

from pipeline.kafka.common import (
    ASSIGN_ONLY_GROUP_PREFIX,
    DEFAULT_BOOTSTRAP,
    WedgedClient,
    check_reachable,
    client_conf,
    client_log_to,
    decode_message,
    is_transient,
    next_offsets,
    raise_if_auth_failed,
    retry_transient,
    wait_for,
    wedged_clients,
)
from pipeline.kafka.consumer import Consumer
from pipeline.kafka.producer import Producer
from pipeline.kafka.txn import ExactlyOnceLoop

__all__ = [
    "ASSIGN_ONLY_GROUP_PREFIX",
    "DEFAULT_BOOTSTRAP",
    "OFFSET_BEGINNING",
    "TIMESTAMP_LOG_APPEND_TIME",
    "Consumer",
    "ExactlyOnceLoop",
    "Message",
    "Producer",
    "TopicPartition",
    "WedgedClient",
    "check_reachable",
    "client_conf",
    "client_log_to",
    "decode_message",
    "is_transient",
    "next_offsets",
    "raise_if_auth_failed",
    "retry_transient",
    "wait_for",
    "wedged_clients",
]
