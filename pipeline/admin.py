"""Admin helper: create, describe and delete rlstream's topics; read offsets and group lag.

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

    @property
    def client(self) -> AdminClient:
        if self._client is None:
            self._client = AdminClient(self.conf)
        return self._client

    def list_topics(self) -> set[str]:
        try:
            return set(self.client.list_topics(timeout=self.timeout).topics)
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
            futures = self.client.create_topics(new, operation_timeout=self.timeout, request_timeout=self.timeout)
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
            for fut in self.client.incremental_alter_configs([res]).values():
                fut.result()
            log.info("updated topic configs %s", kv(topic=name, changed=",".join(sorted(diff))))
            changed = True
        if info.partitions < spec.partitions:
            for fut in self.client.create_partitions([NewPartitions(name, spec.partitions)]).values():
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
        md = self.client.list_topics(timeout=self.timeout)
        out: dict[str, TopicInfo] = {}
        missing = [n for n in names if n not in md.topics or md.topics[n].error is not None]
        if missing:
            raise TopicError(f"topic(s) not found: {', '.join(missing)}")
        resources = [ConfigResource(ConfigResource.Type.TOPIC, n) for n in names]
        configs = {}
        for res, fut in self.client.describe_configs(resources, request_timeout=self.timeout).items():
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
        from confluent_kafka import Consumer as _C

        if partitions is None:
            partitions = len(self.client.list_topics(topic, timeout=self.timeout).topics[topic].partitions)
        c = _C({**self.conf, "group.id": "rlstream-admin-watermarks", "enable.auto.commit": False})
        try:
            return {
                p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=self.timeout) for p in range(partitions)
            }
        finally:
            c.close()

    def committed(self, group: str, topic: str, partitions: int) -> dict[int, int]:
        """Committed offsets of a consumer group (-1 where none)."""
        req = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in range(partitions)])
        fut = self.client.list_consumer_group_offsets([req], request_timeout=self.timeout)[group]
        res = fut.result()
        return {tp.partition: tp.offset for tp in res.topic_partitions}

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
            for name, fut in self.client.delete_topics(todo, operation_timeout=self.timeout).items():
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
    from pipeline.kafka import client_conf

    specs = cfg.topics.specs()
    wanted = {cfg.topics.name(r): specs[r] for r in (roles or specs)}
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    return admin.create_topics(wanted, cfg.topics.replication_factor)
