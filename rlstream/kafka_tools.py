"""Kafka's own command-line tools with rlstream's settings (``rlstream kafka-tool``), client settings
in the Java tools' properties format, and the least-privilege ACLs of each rlstream role
(docs/how-to/security.md).

The tools run from the same Maven-resolved jars as the local broker (``rlstream.broker``). What
this is not: a wrapper of the tools' options; arguments pass through unchanged.
"""

from __future__ import annotations

import hashlib
import shutil

from pipeline.errors import BrokerError
from pipeline.kafka import ASSIGN_ONLY_GROUP_PREFIX
from pipeline.topology import STAGES, TRANSACTIONAL_STAGE, Topology

KAFKA_TOOLS = {
    "consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "topics": "org.apache.kafka.tools.TopicCommand",
    "console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "get-offsets": "org.apache.kafka.tools.GetOffsetShell",
    "transactions": "org.apache.kafka.tools.TransactionsCommand",
    "log-dirs": "org.apache.kafka.tools.LogDirsCommand",
    "acls": "org.apache.kafka.tools.AclCommand",
    "configs": "kafka.admin.ConfigCommand",
    "features": "org.apache.kafka.tools.FeatureCommand",
}
_CONFIG_FLAGS = {"console-consumer": "--consumer.config"}
"""The option that names a client properties file, where it is not ``--command-config``."""
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def java_client_properties(common: dict) -> str:
    """The Java client properties that match librdkafka's security settings in ``common``
    (``kafka.common``), for Kafka's own tools: ``security.protocol``, ``sasl.mechanism`` with a
    JAAS line from ``sasl.username``/``sasl.password`` (PLAIN, SCRAM), ``ssl.ca.location`` as a
    PEM truststore, ``ssl.endpoint.identification.algorithm``. Other settings are librdkafka's own
    and left out; client certificates (mutual TLS) need a hand-written file."""
    props: dict[str, str] = {}
    if "security.protocol" in common:
        props["security.protocol"] = str(common["security.protocol"]).upper()
    mechanism = str(common.get("sasl.mechanism", common.get("sasl.mechanisms", ""))).upper()
    if mechanism:
        props["sasl.mechanism"] = mechanism
        if mechanism in _LOGIN_MODULES and "sasl.username" in common:
            user, pw = (
                str(common.get(k, "")).replace("\\", "\\\\").replace('"', '\\"')
                for k in ("sasl.username", "sasl.password")
            )
            props["sasl.jaas.config"] = f'{_LOGIN_MODULES[mechanism]} required username="{user}" password="{pw}";'
    if "ssl.ca.location" in common:
        props["ssl.truststore.type"] = "PEM"
        props["ssl.truststore.location"] = str(common["ssl.ca.location"])
    if "ssl.endpoint.identification.algorithm" in common:
        algo = str(common["ssl.endpoint.identification.algorithm"])
        props["ssl.endpoint.identification.algorithm"] = "" if algo == "none" else algo
    return "".join(f"{k}={v}\n" for k, v in props.items())


def kafka_tool_argv(name: str, args: list[str], common: dict | None = None) -> list[str]:
    """argv that runs one of Kafka's own CLI tools (same jars as the local broker). With the
    security settings of ``common`` (``kafka.common``), and no client properties file named in
    ``args``, they are written (mode 0600, in the cache dir) and passed as the tool's
    ``--command-config`` (``--consumer.config`` for console-consumer)."""
    from rlstream.kafka_jars import CACHE_DIR, classpath, java_version  # the broker's jars

    if name not in KAFKA_TOOLS:
        raise BrokerError(f"unknown Kafka tool {name!r}; known: {', '.join(sorted(KAFKA_TOOLS))}")
    java_version()
    quiet = CACHE_DIR / "log4j2-tools.properties"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    quiet.write_text("status = error\nrootLogger.level = WARN\n")
    flag = _CONFIG_FLAGS.get(name, "--command-config")
    extra: list[str] = []
    props = java_client_properties(common or {})
    if props and flag not in args:
        f = CACHE_DIR / f"kafka-tool-{hashlib.sha256(props.encode()).hexdigest()[:16]}.properties"
        f.touch(mode=0o600)
        f.write_text(props)
        extra = [flag, str(f)]
    return [
        shutil.which("java"),
        f"-Dlog4j2.configurationFile={quiet}",
        "-cp",
        classpath(lambda m: None),
        KAFKA_TOOLS[name],
        *args,
        *extra,
    ]


ROLES = ("feed", "rollout", "reward", "trainer")
"""Group id prefix of pipeline.kafka's assign()-only consumers: librdkafka looks their group up
(FindCoordinator), which needs Group Describe, though they never join or commit."""


def role_acls(cfg, principals: dict[str, str] | None = None) -> dict[str, list]:
    """The least-privilege ACLs of each role (``pipeline.admin.Acl`` lists, by role) for the topics,
    consumer groups and transactional ids of the root config ``cfg``. ``principals`` maps a role
    to its Kafka principal (default ``User:<role>``). The table in docs/how-to/security.md is this.

    * every idempotent producer needs only Write on the topics it writes (KIP-679, Kafka 3.0+: no
      cluster IdempotentWrite); Read and Write imply Describe (metadata, offsets);
    * the reward worker's transactions need TransactionalId Write on ``<transactional_id_prefix>-``
      and its offsets go through the transaction, hence Read on its group;
    * consumer groups need Group Read, reading a topic needs Topic Read; the assign()-only readers
      (control followers, the feed's resume scan) need Describe on ``rlstream-nogroup-*``."""
    from pipeline.admin import Acl

    principals = {r: f"User:{r}" for r in ROLES} | (principals or {})
    t = cfg.topics.name

    def topic(role, name, *ops):
        return [Acl(principals[role], "topic", t(name), op) for op in ops]

    def group(role, name, op="read", pattern="literal"):
        return [Acl(principals[role], "group", name, op, pattern)]

    def reader(role):  # assign()-only consumers (control followers, scans) still look up their group
        return group(role, ASSIGN_ONLY_GROUP_PREFIX, "describe", "prefixed")

    topo = Topology(cfg)
    acls = {}
    for role in ROLES:  # what each stage reads, follows and writes: pipeline.topology
        stage = STAGES[role]
        acls[role] = [
            *(topic(role, stage.input, "read") if stage.input else []),
            *(group(role, topo.group(role)) if stage.input else []),
            *(a for name in stage.follows for a in topic(role, name, "read")),
            *(reader(role) if stage.follows else []),
            *(a for name in stage.outputs for a in topic(role, name, "write")),
        ]
        if role == TRANSACTIONAL_STAGE:
            acls[role].append(Acl(principals[role], "transactional_id", topo.transactional_id(""), "write", "prefixed"))
    if cfg.feed.dispatch == "paced":  # the feed reads the rollout group's committed offsets
        acls["feed"] += group("feed", topo.group("rollout"), "describe")
    return acls
