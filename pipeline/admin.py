"""Admin helper (part of the Kafka wrapper, with ``pipeline.kafka``): create, describe and delete rlstream's topics; read offsets and group lag.

``create_topics`` is idempotent: an existing topic is left as is when it matches its spec, its
configs are brought in line when they differ, and a partition count below the spec is raised
(Kafka cannot lower one, so a higher count is reported, not changed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)

from pipeline.errors import TopicError
from pipeline.kafka import Consumer, client_conf, retry_transient
from pipeline.log import kv

log = logging.getLogger(__name__)


def topic_configs(spec) -> dict[str, str]:
    return {
        "retention.ms": str(spec.retention_ms),
        "cleanup.policy": spec.cleanup_policy,
        "max.message.bytes": str(spec.max_message_bytes),
        **spec.extra,
    }


@dataclass
class TopicInfo:
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str] = field(default_factory=dict)
    offsets: dict[int, tuple[int, int]] = field(default_factory=dict)  # partition -> (low, high)

    @property
    def messages(self) -> int:
        return sum(hi - lo for lo, hi in self.offsets.values())


class Admin:
    def __init__(self, conf: dict, timeout: float = 30.0):
        self.conf = conf
        self.timeout = timeout
        self._client: AdminClient | None = None
        self._reader: Consumer | None = None

    @property
    def _admin(self) -> AdminClient:
        if self._client is None:
            self._client = AdminClient(self.conf)
        return self._client

    def list_topics(self) -> set[str]:
        try:
            return set(retry_transient(lambda: self._admin.list_topics(timeout=self.timeout), self.timeout).topics)
        except KafkaException as exc:
            raise TopicError(f"cannot list topics: {exc.args[0]}", exc.args[0]) from exc

    def create_topics(self, specs: dict[str, object], default_rf: int = 1) -> dict[str, str]:
        """Create ``{full_name: TopicSpec}``. Returns ``{name: created|exists|updated}``."""
        existing = self.list_topics()
        result: dict[str, str] = {}
        new = [
            NewTopic(
                name,
                num_partitions=spec.partitions,
                replication_factor=spec.replication_factor or default_rf,
                config=topic_configs(spec),
            )
            for name, spec in specs.items()
            if name not in existing
        ]
        if new:
            futures = self._admin.create_topics(new, operation_timeout=self.timeout, request_timeout=self.timeout)
            for name, fut in futures.items():
                try:
                    fut.result()
                    result[name] = "created"
                    log.info("created topic %s", kv(topic=name, partitions=specs[name].partitions))
                except KafkaException as exc:
                    err = exc.args[0]
                    if err.code() != KafkaError.TOPIC_ALREADY_EXISTS:  # raced with another creator
                        raise TopicError(f"cannot create topic {name}: {err}", err) from exc
                    existing.add(name)
        for name in specs:
            if name in existing:
                result[name] = self._reconcile(name, specs[name])
        return result

    def _reconcile(self, name: str, spec) -> str:
        info = self.describe([name])[name]
        changed = False
        want = topic_configs(spec)
        diff = {k: v for k, v in want.items() if info.configs.get(k) != v}
        if diff:
            res = ConfigResource(
                ConfigResource.Type.TOPIC,
                name,
                incremental_configs=[
                    ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in diff.items()
                ],
            )
            for fut in self._admin.incremental_alter_configs([res]).values():
                fut.result()
            log.info("updated topic configs %s", kv(topic=name, changed=",".join(sorted(diff))))
            changed = True
        if info.partitions < spec.partitions:
            for fut in self._admin.create_partitions([NewPartitions(name, spec.partitions)]).values():
                fut.result()
            log.info("added partitions %s", kv(topic=name, partitions=spec.partitions))
            changed = True
        elif info.partitions > spec.partitions:
            log.warning(
                "topic has more partitions than configured; Kafka cannot shrink it %s",
                kv(topic=name, actual=info.partitions, configured=spec.partitions),
            )
        return "updated" if changed else "exists"

    def describe(self, names: list[str], with_offsets: bool = False) -> dict[str, TopicInfo]:
        md = retry_transient(lambda: self._admin.list_topics(timeout=self.timeout), self.timeout)
        out: dict[str, TopicInfo] = {}
        missing = [n for n in names if n not in md.topics or md.topics[n].error is not None]
        if missing:
            raise TopicError(f"topic(s) not found: {', '.join(missing)}")
        resources = [ConfigResource(ConfigResource.Type.TOPIC, n) for n in names]
        configs = {}
        for res, fut in self._admin.describe_configs(resources, request_timeout=self.timeout).items():
            configs[res.name] = {k: v.value for k, v in fut.result().items()}
        for n in names:
            parts = md.topics[n].partitions
            rf = len(next(iter(parts.values())).replicas) if parts else 0
            out[n] = TopicInfo(n, len(parts), rf, configs.get(n, {}))
        if with_offsets:
            for n, info in out.items():
                info.offsets = self.watermarks(n, info.partitions)
        return out

    def watermarks(self, topic: str, partitions: int | None = None) -> dict[int, tuple[int, int]]:
        """partition -> (low, high) offsets (high = next offset to be written)."""
        if self._reader is None:  # one reader for the admin's life, not one client per call
            self._reader = Consumer(self.conf)
        c = self._reader
        parts = range(partitions) if partitions is not None else c.partitions(topic, self.timeout)
        return {p: c.watermarks(topic, p, self.timeout) for p in parts}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def committed(self, group: str, topic: str, partitions: int) -> dict[int, int]:
        """Committed offsets of a consumer group (-1 where none)."""
        req = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in range(partitions)])
        fut = self._admin.list_consumer_group_offsets([req], request_timeout=self.timeout)[group]
        res = fut.result()
        return {tp.partition: tp.offset for tp in res.topic_partitions}

    def group_state(self, group: str) -> tuple[str, int, int]:
        """(state, members, members holding partitions) of a consumer group, e.g. ("STABLE", 2, 2)."""
        try:
            desc = self._admin.describe_consumer_groups([group], request_timeout=self.timeout)[group].result()
        except KafkaException as exc:
            raise TopicError(f"cannot describe group {group}: {exc.args[0]}", exc.args[0]) from exc
        assigned = [m for m in desc.members if m.assignment and m.assignment.topic_partitions]
        return str(desc.state).rsplit(".", 1)[-1], len(desc.members), len(assigned)

    def lag(self, group: str, topic: str) -> dict[int, int]:
        """Records not yet committed by ``group``, per partition."""
        marks = self.watermarks(topic)
        committed = self.committed(group, topic, len(marks))
        return {p: hi - (committed.get(p, -1) if committed.get(p, -1) >= 0 else lo) for p, (lo, hi) in marks.items()}

    def delete_topics(self, names: list[str]) -> dict[str, str]:
        existing = self.list_topics()
        result = {n: "absent" for n in names if n not in existing}
        todo = [n for n in names if n in existing]
        if todo:
            for name, fut in self._admin.delete_topics(todo, operation_timeout=self.timeout).items():
                try:
                    fut.result()
                    result[name] = "deleted"
                except KafkaException as exc:
                    err = exc.args[0]
                    if err.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                        raise TopicError(f"cannot delete topic {name}: {err}", err) from exc
                    result[name] = "absent"
        return result


def ensure_topics(cfg, roles: list[str] | None = None) -> dict[str, str]:
    """Create the configured topics (all roles by default). ``cfg`` is the root Config."""
    specs = cfg.topics.specs()
    wanted = {cfg.topics.name(r): specs[r] for r in (roles or specs)}
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    return admin.create_topics(wanted, cfg.topics.replication_factor)
