"""Typed errors of rlstream. Every error a user can cause or a worker can hit has a type here."""

from __future__ import annotations


class RlstreamError(Exception):
    """Base class of all rlstream errors."""


class ConfigError(RlstreamError):
    """A configuration value is missing, unknown or out of bounds. The message names the key."""


EXIT_CONFIG = 78
"""Exit code of a supervised role stopped by a ConfigError (sysexits' EX_CONFIG): a mistake that a
restart cannot mend, so ``rlstream.supervisor`` stops the run instead of restarting the role."""


class CheckpointDamaged(ConfigError):
    """No trainer checkpoint the pointer names is intact (a file missing or not matching its
    sha256). A restart cannot mend it, like a ConfigError: the message names the file."""


class SerializationError(RlstreamError):
    """A value could not be encoded to Avro."""


class DecodeError(RlstreamError):
    """Bytes could not be decoded into a known schema.

    Carries where the bytes came from, so a dead-letter record can name them.
    """

    def __init__(self, reason: str, *, topic=None, partition=None, offset=None, error_type="decode"):
        self.reason = reason
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.error_type = error_type
        where = ""
        if topic is not None:
            where = f" (topic={topic} partition={partition} offset={offset})"
        super().__init__(f"{reason}{where}")

    def located(self, topic: str, partition: int, offset: int) -> DecodeError:
        return DecodeError(self.reason, topic=topic, partition=partition, offset=offset, error_type=self.error_type)


class KafkaClientError(RlstreamError):
    """A Kafka client operation failed. ``kafka_error`` is the confluent_kafka.KafkaError if any."""

    def __init__(self, message: str, kafka_error=None):
        self.kafka_error = kafka_error
        super().__init__(message)

    @property
    def retriable(self) -> bool:
        return bool(self.kafka_error is not None and self.kafka_error.retriable())

    @property
    def fatal(self) -> bool:
        return bool(self.kafka_error is not None and self.kafka_error.fatal())


class BrokerUnreachable(KafkaClientError):
    """No broker of ``bootstrap`` answered within a bounded check: a command run by hand stops with
    this instead of retrying (roles under a supervisor retry up to ``liveness.startup_timeout_s``)."""

    def __init__(self, message: str, bootstrap: str, kafka_error=None):
        self.bootstrap = bootstrap
        super().__init__(message, kafka_error)


class DeliveryError(KafkaClientError):
    """A produced message was not delivered. Raised on the next produce() or flush()."""


class ConsumeError(KafkaClientError):
    """The consumer returned an error for a topic/partition."""


class TopicError(KafkaClientError):
    """Creating, describing or deleting a topic failed."""


class UnknownVersion(RlstreamError):
    """A policy version asked for (``export``, ``eval --version``) was never published, or its
    weights are gone from the store. The message lists the versions there are."""


class JobFailed(RlstreamError):
    """A job run (``rlstream.Job.run``) ended short of its target: a role died, crash-looped or
    hung for good. ``report`` is the run's report, also in ``<run dir>/report.json``."""

    def __init__(self, message: str, report: dict):
        self.report = report
        super().__init__(message)


class BrokerError(RlstreamError):
    """The local broker could not be set up, started or stopped."""


class JobAlreadyRunning(RlstreamError):
    """Another run of the same job (its lease on the job's lease topic, or its run dir) is alive:
    a second launch is refused before it starts a role or writes to the run dir. The message
    names the running one (pid, host, start time, run id) and what to do."""


class JobChanged(RlstreamError):
    """A launch of an existing job with settings that change what it learns (model, data, reward,
    loss, group size, prompt format, tools, ...) or where it lives (run dir, checkpoint store,
    topics): refused before anything starts. The message names each changed key with its old and
    new value; start the job over (``--restart``), branch it (``--fork NEW``), or undo the change."""


class NothingToTrain(RlstreamError):
    """A launch of a job that has already reached the asked-for ``trainer.max_steps``: nothing would
    be trained. Give a higher ``--steps``, or start the job over."""
