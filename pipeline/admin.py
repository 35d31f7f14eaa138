"""Admin helper (part of the Kafka wrapper, with ``pipeline.kafka``): create, describe and delete rlstream's topics; read offsets and group lag; grant and list ACLs; set SCRAM users.

Replication: a topic takes the cluster's by default (``replication``: ``min(3, brokers)``
replicas, ``min.insync.replicas`` 2 at 3); an explicit replication factor above the broker count
is refused in one line before anything is created. ``create_topics`` is idempotent: an existing topic is left as is when it matches its spec, its
configs are brought in line when they differ, and a partition count below the spec is raised
(Kafka cannot lower one, so a higher count is reported, not changed).

ACLs are given as ``Acl`` values (plain strings, so callers never touch confluent-kafka's enums);
``create_acls`` is idempotent (Kafka ignores a binding that already exists).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from pipeline.errors import ConfigError, KafkaClientError, TopicError
from pipeline.kafka import Consumer, client_conf, retry_transient
from pipeline.log import kv

log = logging.getLogger(__name__)


def topic_configs(spec, min_insync_replicas: int | None = None) -> dict[str, str]:
    """The topic configs of TopicSpec ``spec`` (``min_insync_replicas``: topics.min_insync_replicas;
    None leaves the broker's default; a ``min.insync.replicas`` in ``spec.extra`` wins)."""
    isr = {} if min_insync_replicas is None else {"min.insync.replicas": str(min_insync_replicas)}
    return {
        "retention.ms": str(spec.retention_ms),
        "cleanup.policy": spec.cleanup_policy,
        "max.message.bytes": str(spec.max_message_bytes),
        **isr,
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


CLUSTER_RESOURCE = "kafka-cluster"
"""The name of Kafka's one cluster resource (ACLs such as IdempotentWrite, ClusterAction)."""
_RESOURCE_TYPES = {
    "topic": ResourceType.TOPIC,
    "group": ResourceType.GROUP,
    "transactional_id": ResourceType.TRANSACTIONAL_ID,
    "cluster": ResourceType.BROKER,  # librdkafka's BROKER (4) is Kafka's CLUSTER resource type
}
_OPERATIONS = {
    op.name.lower(): op for op in AclOperation if op not in (AclOperation.UNKNOWN, AclOperation.ANY)
}  # all, read, write, create, delete, alter, describe, cluster_action, describe_configs, alter_configs, idempotent_write
_PATTERNS = {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}
_PERMISSIONS = {"allow": AclPermissionType.ALLOW, "deny": AclPermissionType.DENY}


@dataclass(frozen=True)
class Acl:
    """One ACL binding: ``principal`` (``User:<name>``) is allowed (or denied) ``operation`` on a
    resource, from ``host``. All fields are plain lower-case strings:

    * ``resource_type``: ``topic``, ``group``, ``transactional_id`` or ``cluster`` (its name is
      always ``kafka-cluster``);
    * ``pattern``: ``literal`` (the exact name, or ``*`` for every name) or ``prefixed``;
    * ``operation``: ``read``, ``write``, ``describe``, ``create``, ``delete``, ``alter``,
      ``describe_configs``, ``alter_configs``, ``idempotent_write``, ``cluster_action`` or ``all``.
    """

    principal: str
    resource_type: str
    name: str
    operation: str
    pattern: str = "literal"
    permission: str = "allow"
    host: str = "*"

    def binding(self) -> AclBinding:
        def pick(table: dict, value: str, what: str):
            try:
                return table[value]
            except KeyError:
                raise ConfigError(f"ACL {what} {value!r} unknown; known: {', '.join(table)}") from None

        if ":" not in self.principal:
            raise ConfigError(f"ACL principal {self.principal!r} must look like User:<name>")
        rtype = pick(_RESOURCE_TYPES, self.resource_type, "resource_type")
        name = CLUSTER_RESOURCE if rtype == ResourceType.BROKER else self.name
        return AclBinding(
            rtype,
            name,
            pick(_PATTERNS, self.pattern, "pattern"),
            self.principal,
            self.host,
            pick(_OPERATIONS, self.operation, "operation"),
            pick(_PERMISSIONS, self.permission, "permission"),
        )

    @classmethod
    def of(cls, b: AclBinding) -> Acl:
        rtype = {v: k for k, v in _RESOURCE_TYPES.items()}.get(b.restype, b.restype.name.lower())
        return cls(
            b.principal,
            rtype,
            b.name,
            b.operation.name.lower(),
            b.resource_pattern_type.name.lower(),
            b.permission_type.name.lower(),
            b.host,
        )

    def __str__(self) -> str:
        where = f"{self.resource_type}:{self.name}" + ("*" if self.pattern == "prefixed" else "")
        return f"{self.permission} {self.principal} {self.operation} {where}" + (
            f" from {self.host}" if self.host != "*" else ""
        )


class Admin:
    def __init__(self, conf: dict, timeout: float = 30.0):
        self.conf = conf
        self.timeout = timeout
        self._client: AdminClient | None = None
        self._reader: Consumer | None = None
        self._group_readers: dict[str, Consumer] = {}

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

    def broker_count(self) -> int:
        """How many brokers the cluster's metadata names."""
        md = retry_transient(lambda: self._admin.list_topics(timeout=self.timeout), self.timeout)
        return len(md.brokers)

    def partition_leaders(self, topic: str) -> dict[int, int]:
        """partition -> node id of its leader (-1 while it has none)."""
        md = retry_transient(lambda: self._admin.list_topics(topic, timeout=self.timeout), self.timeout)
        t = md.topics.get(topic)
        if t is None or t.error is not None:
            raise TopicError(f"topic not found: {topic}")
        return {p: part.leader for p, part in t.partitions.items()}

    def in_sync_replicas(self, topic: str) -> dict[int, list[int]]:
        """partition -> node ids of its in-sync replicas."""
        md = retry_transient(lambda: self._admin.list_topics(topic, timeout=self.timeout), self.timeout)
        return {p: list(part.isrs) for p, part in md.topics[topic].partitions.items()}

    def group_coordinator(self, group: str) -> int:
        """Node id of the coordinator of consumer group ``group``."""
        try:
            desc = self._admin.describe_consumer_groups([group], request_timeout=self.timeout)[group].result()
        except KafkaException as exc:
            raise TopicError(f"cannot describe group {group}: {exc.args[0]}", exc.args[0]) from exc
        return desc.coordinator.id

    def create_topics(
        self, specs: dict[str, object], default_rf: int | None = None, min_insync_replicas: int | None = None
    ) -> dict[str, str]:
        """Create ``{full_name: TopicSpec}`` (``default_rf``: where a spec has no replication
        factor, None: the cluster's; ``min_insync_replicas``: ``topic_configs``, None: see
        ``replication``). Returns ``{name: created|exists|updated}``. ConfigError (one line, nothing
        created) if a topic to create asks for more replicas than the cluster has brokers."""
        existing = self.list_topics()
        result: dict[str, str] = {}
        todo = {name: spec for name, spec in specs.items() if name not in existing}
        brokers = self.broker_count() if todo else 0
        new = []
        for name, spec in todo.items():
            rf, isr = replication(brokers, spec.replication_factor or default_rf, min_insync_replicas, name)
            new.append(
                NewTopic(name, num_partitions=spec.partitions, replication_factor=rf, config=topic_configs(spec, isr))
            )
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
            self._await_metadata({n: specs[n].partitions for n, r in result.items() if r == "created"})
        for name in specs:
            if name in existing:
                result[name] = self._reconcile(name, specs[name], min_insync_replicas)
        return result

    def _await_metadata(self, want: dict[str, int]) -> None:
        """Until the metadata answer names every topic of ``want`` (name -> partitions) with at
        least that many partitions, each with a leader: a broker (on a cluster, one other than the
        controller) may show a new topic or new partitions a moment after the call returned."""
        deadline = time.monotonic() + self.timeout
        names = list(want)
        while names:
            md = retry_transient(lambda: self._admin.list_topics(timeout=self.timeout), self.timeout)
            names = [
                n
                for n in names
                if n not in md.topics
                or md.topics[n].error is not None
                or len(md.topics[n].partitions) < want[n]
                or any(p.leader < 0 for p in md.topics[n].partitions.values())
            ]
            if names and time.monotonic() > deadline:
                raise TopicError(f"topic(s) created but not in the metadata after {self.timeout}s: {', '.join(names)}")
            if names:
                time.sleep(0.1)

    def _reconcile(self, name: str, spec, min_insync_replicas: int | None) -> str:
        info = self.describe([name])[name]
        changed = False
        want = topic_configs(spec, min_insync_replicas)
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
            self._await_metadata({name: spec.partitions})
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
        readers, self._group_readers = list(self._group_readers.values()), {}
        for reader in readers:
            reader.close()

    def committed(self, group: str, topic: str, partitions: int) -> dict[int, int]:
        """Committed offsets of a consumer group (-1 where none).

        Read by a consumer that carries the group's id and never joins it (no subscribe: the group
        does not see it), not by the admin API: librdkafka's ListConsumerGroupOffsets dereferences
        the missing consumer-group handle of an admin client when a broker answers NOT_COORDINATOR
        (librdkafka #5040, open), and that segfault ended a chaos launcher three times out of three
        in a cluster's rolling restart."""
        reader = self._group_readers.get(group)
        if reader is None:
            # read_uncommitted: offsets as they stand (the admin API's default), without waiting for
            # a transaction in flight to settle (require_stable is read_committed's)
            conf = {**self.conf, "isolation.level": "read_uncommitted"}
            reader = self._group_readers[group] = Consumer(conf, group_id=group)
        got = reader.committed([(topic, p) for p in range(partitions)], self.timeout)
        return {p: off for (_, p), off in got.items()}

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

    def list_groups(self) -> set[str]:
        """The ids of every consumer group the cluster knows."""
        try:
            got = self._admin.list_consumer_groups(request_timeout=self.timeout).result()
        except KafkaException as exc:
            raise TopicError(f"cannot list consumer groups: {exc.args[0]}", exc.args[0]) from exc
        return {g.group_id for g in got.valid}

    def delete_groups(self, groups: list[str]) -> dict[str, str]:
        """Delete consumer groups: group -> ``deleted``, ``absent`` or ``not empty`` (members still in
        it: a static member stays until its session times out)."""
        existing = self.list_groups()
        result = {g: "absent" for g in groups if g not in existing}
        todo = [g for g in groups if g in existing]
        if todo:
            for group, fut in self._admin.delete_consumer_groups(todo, request_timeout=self.timeout).items():
                try:
                    fut.result()
                    result[group] = "deleted"
                except KafkaException as exc:
                    err = exc.args[0]
                    if err.code() == KafkaError.GROUP_ID_NOT_FOUND:
                        result[group] = "absent"
                    elif err.code() == KafkaError.NON_EMPTY_GROUP:
                        result[group] = "not empty"
                    else:
                        raise TopicError(f"cannot delete consumer group {group}: {err}", err) from exc
        return result

    # -- security --------------------------------------------------------------------------------
    def create_acls(self, acls: list[Acl], wait: bool = True) -> int:
        """Create every binding of ``acls`` (existing ones are left as they are); returns how many
        were sent. With ``wait``, return only once the broker answering describes them all (a
        binding is in effect once the broker has the metadata that holds it; within ``timeout``).
        KafkaClientError names the first binding the broker refused (e.g. SECURITY_DISABLED
        without an authorizer, CLUSTER_AUTHORIZATION_FAILED for a non-admin)."""
        bindings = {acl.binding(): acl for acl in acls}
        if not bindings:
            return 0
        try:
            futures = self._admin.create_acls(list(bindings), request_timeout=self.timeout)
        except KafkaException as exc:
            raise KafkaClientError(f"cannot create ACLs: {exc.args[0]}", exc.args[0]) from exc
        for binding, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                raise KafkaClientError(f"cannot create ACL ({bindings[binding]}): {exc.args[0]}", exc.args[0]) from exc
        want = {Acl.of(b) for b in bindings}  # normalised (e.g. the cluster resource's name)
        deadline = time.monotonic() + self.timeout
        while wait and (missing := want - set(self.describe_acls())):
            if time.monotonic() > deadline:
                raise KafkaClientError(
                    f"ACLs created but not in effect after {self.timeout}s: {sorted(map(str, missing))}"
                )
            time.sleep(0.05)
        log.info("created ACLs %s", kv(count=len(bindings)))
        return len(bindings)

    def _acl_filter(self, principal, resource_type, name, pattern) -> AclBindingFilter:
        rtypes = {"any": ResourceType.ANY, **_RESOURCE_TYPES}
        patterns = {"any": ResourcePatternType.ANY, "match": ResourcePatternType.MATCH, **_PATTERNS}
        if resource_type not in rtypes or pattern not in patterns:
            raise ConfigError(
                f"ACL filter: resource_type {resource_type!r} (known: {', '.join(rtypes)}) or pattern "
                f"{pattern!r} (known: {', '.join(patterns)}) unknown"
            )
        if resource_type == "cluster":
            name = CLUSTER_RESOURCE
        return AclBindingFilter(
            rtypes[resource_type],
            name,
            patterns[pattern],
            principal,
            None,
            AclOperation.ANY,
            AclPermissionType.ANY,
        )

    def describe_acls(
        self, principal: str | None = None, resource_type: str = "any", name: str | None = None, pattern: str = "any"
    ) -> list[Acl]:
        """ACL bindings matching the filter (None and ``any`` match everything; ``pattern="match"``
        finds every binding that applies to resource ``name``: literal, ``*`` and prefixes)."""
        flt = self._acl_filter(principal, resource_type, name, pattern)
        try:
            found = self._admin.describe_acls(flt, request_timeout=self.timeout).result()
        except KafkaException as exc:
            raise KafkaClientError(f"cannot describe ACLs: {exc.args[0]}", exc.args[0]) from exc
        return sorted((Acl.of(b) for b in found), key=str)

    def delete_acls(
        self, principal: str | None = None, resource_type: str = "any", name: str | None = None, pattern: str = "any"
    ) -> list[Acl]:
        """Delete the ACL bindings matching the filter (as ``describe_acls``); returns them."""
        flt = self._acl_filter(principal, resource_type, name, pattern)
        try:
            deleted = self._admin.delete_acls([flt], request_timeout=self.timeout)[flt].result()
        except KafkaException as exc:
            raise KafkaClientError(f"cannot delete ACLs: {exc.args[0]}", exc.args[0]) from exc
        return sorted((Acl.of(b) for b in deleted), key=str)

    def upsert_scram_users(self, users: dict[str, str], mechanism: str = "SCRAM-SHA-512", iterations: int = 8192):
        """Create the SCRAM credentials of ``users`` (name -> password), or replace their passwords."""
        if not users:
            return
        try:
            mech = ScramMechanism[mechanism.replace("-", "_").upper()]
        except KeyError:
            raise ConfigError(f"SCRAM mechanism {mechanism!r} unknown; known: SCRAM-SHA-256, SCRAM-SHA-512") from None
        info = ScramCredentialInfo(mech, iterations)
        alterations = [UserScramCredentialUpsertion(u, info, pw.encode()) for u, pw in sorted(users.items())]
        try:
            futures = self._admin.alter_user_scram_credentials(alterations, request_timeout=self.timeout)
        except KafkaException as exc:
            raise KafkaClientError(f"cannot set SCRAM credentials: {exc.args[0]}", exc.args[0]) from exc
        for user, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                raise KafkaClientError(
                    f"cannot set the SCRAM credential of {user}: {exc.args[0]}", exc.args[0]
                ) from exc
        log.info("set SCRAM credentials %s", kv(users=",".join(sorted(users)), mechanism=mechanism))


def replication(brokers: int, rf: int | None, isr: int | None, topic: str = "topics") -> tuple[int, int | None]:
    """(replication factor, min.insync.replicas) of a topic to create on a cluster of ``brokers``.
    ``rf`` None: the cluster's, ``min(3, brokers)``; ``isr`` None: ``rf - 1`` from 3 replicas up
    (one broker may be down without refusing a write or losing an acknowledged one), else the
    broker's default. ConfigError if ``rf`` exceeds ``brokers`` or ``isr`` exceeds ``rf``."""
    if rf is None:
        rf = max(1, min(3, brokers))
    elif rf > brokers:
        raise ConfigError(
            f"topics.replication_factor = {rf} for {topic}, but the cluster has {brokers} broker(s): lower it, "
            "or leave it unset to take the cluster's"
        )
    if isr is None and rf >= 3:
        isr = rf - 1
    if isr is not None and isr > rf:
        raise ConfigError(
            f"topics.min_insync_replicas = {isr} for {topic}, but it has {rf} replica(s) on a cluster of {brokers} "
            "broker(s): no acks=all write could succeed"
        )
    return rf, isr


def has_topic(cfg, topic: str) -> bool:
    """Whether ``topic`` exists on the cluster of ``cfg`` (one bounded metadata request)."""
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    try:
        return topic in admin.list_topics()
    finally:
        admin.close()


def ensure_topics(cfg, roles: list[str] | None = None) -> dict[str, str]:
    """Create the configured topics (all roles by default). ``cfg`` is the root Config."""
    specs = cfg.topics.specs()
    wanted = {cfg.topics.name(r): specs[r] for r in (roles or specs)}
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    return admin.create_topics(wanted, cfg.topics.replication_factor, cfg.topics.min_insync_replicas)
