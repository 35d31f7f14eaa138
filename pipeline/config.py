"""Config sections every role shares, and the machinery that loads any rlstream config.

The sections here (``KafkaConfig``, ``TopicsConfig``, ``RLConfig``, ``LivenessConfig``) are what
the core needs; each role keeps its own section next to its code (``producers.config``,
``consumers.*.config``), and the application layer (``rlstream.config``) composes them into the
root ``Config``. This module never imports a role.

Loading (``load_tree``/``validate``): defaults < TOML file < environment
(``RLSTREAM_SECTION__KEY=value``) < CLI overrides (``--set section.key=value``). Values from the
environment and ``--set`` are parsed as TOML literals when they parse (``3``, ``true``,
``[1, 2]``), otherwise taken as strings. Every error names the bad key. Code that composes a
config (a launcher, a benchmark) gives typed settings instead, dotted key -> Python value
(``settings_tree``, ``with_settings``): nothing is formatted to a string and parsed back.

Renamed keys (``RENAMED``) keep working: each layer's old key is moved onto the new one with a
``FutureWarning`` naming it; one layer setting both to different values is an error naming both.
"""

from __future__ import annotations

import copy
import os
import re
import tomllib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from pipeline.errors import ConfigError

ENV_PREFIX = "RLSTREAM_"
NON_CONFIG_ENV = frozenset(
    {
        "CONFIG",
        "HOME",
        "CACHE",
        "VENV",
        "KAFKA_POM",
        "QUIET",
        "TEST_SEED",
        "TEST_DOCKER",
        "TEST_FULL",
        "PARENT_PID",
        "FORKSERVER_ASSUME_CUDA",
    }
)
"""``RLSTREAM_*`` environment variables that are not config keys (paths, test and setup switches)."""
DEFAULT_HOME = Path(os.environ.get("RLSTREAM_HOME", Path.home() / ".rlstream"))


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _takes_none_not_str(annotation: Any) -> bool:
    """``annotation`` (a field's type) is a number or None: ``"none"`` can only mean None."""
    import types
    import typing

    args = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else ()
    return type(None) in args and all(a in (int, float, type(None)) for a in args)


NONE = "none"
"""How a config file or ``--set`` spells None (TOML has no null) for a setting whose default is
not None (``trainer.loss.behav_weight_cap = "none"``: uncapped); ``dump_toml`` writes it so."""


class StrictModel(BaseModel):
    """Base of every rlstream config model: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _none_spelled_out(cls, data: Any) -> Any:
        """``"none"`` is None for a setting that may be None and is not a string."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            f = cls.model_fields.get(name)
            if not isinstance(value, str) or f is None or not _takes_none_not_str(f.annotation):
                continue
            if value.lower() == NONE:
                out[name] = None
            elif not _number(value):
                raise ValueError(f'{name} = {value!r}: give a value of its type, or "{NONE}" for none')
        return out


class PluginConfig(StrictModel):
    """A user plug-in in place of a built-in (an engine, ...): ``type = "my_pkg.module:MyClass"``."""

    type: str
    """Dotted path of the plug-in class, ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings handed to the plug-in as its config (``config.options``)."""

    @field_validator("type")
    @classmethod
    def _dotted(cls, v: str) -> str:
        from pipeline.plugins import is_dotted

        if not is_dotted(v):
            raise ValueError(f"unknown type {v!r}: not a built-in and not package.module:Class")
        return v


def plugin_union(
    *builtins: type[StrictModel],
    plugin: type[StrictModel] = PluginConfig,
    key: str = "type",
    default: str | None = None,
):
    """A discriminated union on ``key`` (``type``) of built-in config models, plus ``plugin``
    (``PluginConfig``) for any other value (a user plug-in named by its dotted path). ``default``:
    the built-in a table without ``key`` stands for (None: such a table is the plug-in's)."""
    names = {m.model_fields[key].default: m for m in builtins}

    def tag(v) -> str:
        t = v.get(key, default) if isinstance(v, dict) else getattr(v, key, None)
        return t if t in names else "plugin"

    members = (*(Annotated[m, Tag(n)] for n, m in names.items()), Annotated[plugin, Tag("plugin")])
    return Annotated[Union[members], Discriminator(tag)]  # noqa: UP007 - built from a tuple


class KafkaConfig(StrictModel):
    bootstrap_servers: str | None = None
    """host:port list. None: the local broker's recorded address if it runs, else 127.0.0.1:9092
    (resolved once, at start-up, by the command line)."""
    client_id_prefix: str = "rlstream"
    """Prefix of every client.id, followed by role and worker id."""
    producer: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra librdkafka producer settings (e.g. linger.ms, compression.type)."""
    consumer: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra librdkafka consumer settings. ``"group.protocol" = "consumer"``: the KIP-848 group
    protocol (Kafka 4.x brokers; docs/how-to/multi-machine.md, "Rebalances")."""
    common: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra librdkafka settings for every client (security.protocol, sasl.*, ...)."""
    request_timeout_s: float = Field(30.0, gt=0)
    """Timeout of admin calls and flushes."""

    @field_validator("consumer")
    @classmethod
    def _group_protocol(cls, v: dict) -> dict:
        """A wrong ``group.protocol`` fails here, in one line, not as a client error in every role's log."""
        proto = v.get("group.protocol")
        if proto is not None and str(proto).lower() not in ("classic", "consumer"):
            raise ValueError(
                f'group.protocol = {proto!r}: "classic" (the default) or "consumer" (KIP-848, Kafka 4.x brokers)'
            )
        return v


class TopicSpec(StrictModel):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    """Topic name without the prefix."""
    partitions: int = Field(ge=1, le=10_000)
    """Partition count. More partitions allow more consumers in a group."""
    replication_factor: int | None = Field(None, ge=1)
    """None: topics.replication_factor."""
    retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=-1)
    """retention.ms; -1 keeps forever."""
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = "delete"
    """cleanup.policy."""
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """max.message.bytes (the broker's message.max.bytes must be at least this)."""
    extra: dict[str, str] = Field(default_factory=dict)
    """Other topic configs, passed through verbatim."""


class TopicsConfig(StrictModel):
    prefix: str = Field("rl.", pattern=r"^[A-Za-z0-9._-]*$")
    """Prepended to every topic name; lets several runs share one cluster."""
    replication_factor: int | None = Field(None, ge=1)
    """Default replication factor. None: the cluster's, min(3, brokers) (with min_insync_replicas 2
    at 3 replicas); a value above the broker count is refused before any topic is created."""
    min_insync_replicas: int | None = Field(None, ge=1)
    """``min.insync.replicas`` of every topic: how many replicas (leader included) must hold a
    record before an ``acks=all`` write (every rlstream producer's) succeeds. None: one less than
    the replication factor from 3 replicas up, else the broker's default. 2 with replication_factor 3 survives one broker down without losing an acknowledged
    record. A topic's ``extra`` ``min.insync.replicas`` wins."""
    prompts: TopicSpec = TopicSpec(name="prompts", partitions=8)
    rollouts: TopicSpec = TopicSpec(name="rollouts", partitions=8)
    scored: TopicSpec = TopicSpec(name="scored", partitions=4)
    control: TopicSpec = TopicSpec(name="control", partitions=1, retention_ms=-1)
    metrics: TopicSpec = TopicSpec(name="metrics", partitions=1, retention_ms=24 * 3600 * 1000)
    dlq: TopicSpec = TopicSpec(name="dlq", partitions=1, retention_ms=-1)
    lease: TopicSpec = TopicSpec(
        name="lease",
        partitions=1,
        retention_ms=24 * 3600 * 1000,
        extra={"message.timestamp.type": "LogAppendTime", "segment.ms": str(3600 * 1000)},
    )
    """The job lease of ``rlstream run``/``demo`` (``rlstream.lease``: one run per job): created by
    the launcher, not one of the roles' topics (``specs``). Broker timestamps, so liveness never
    compares two machines' clocks."""
    job: TopicSpec = TopicSpec(name="job", partitions=1, retention_ms=-1)
    """The job's record of ``rlstream run`` (``rlstream.identity``: its resolved settings, written at
    every start, compared at the next): created by the launcher, not one of the roles' topics."""

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data):
        """A partial table (e.g. only ``partitions``) keeps the other per-topic defaults."""
        if isinstance(data, dict):
            data = dict(data)
            for role, field in cls.model_fields.items():
                if isinstance(data.get(role), dict) and isinstance(field.default, TopicSpec):
                    data[role] = {**field.default.model_dump(), **data[role]}
        return data

    @model_validator(mode="after")
    def _check(self):
        if self.control.partitions != 1:
            raise ValueError("topics.control.partitions must be 1 (a late joiner reads the newest notice)")
        if self.lease.partitions != 1:
            raise ValueError("topics.lease.partitions must be 1 (claims are ordered by their offsets)")
        if self.job.partitions != 1:
            raise ValueError("topics.job.partitions must be 1 (the newest record is the job's)")
        if self.replication_factor is not None and (self.min_insync_replicas or 0) > self.replication_factor:
            raise ValueError(
                f"topics.min_insync_replicas ({self.min_insync_replicas}) must not exceed topics.replication_factor "
                f"({self.replication_factor}): no acks=all write could succeed"
            )
        return self

    def specs(self) -> dict[str, TopicSpec]:
        """Role name -> spec, in a stable order."""
        return {k: getattr(self, k) for k in ("prompts", "rollouts", "scored", "control", "metrics", "dlq")}

    def name(self, role: str) -> str:
        """Full topic name of a role (or ``lease``, ``job``), e.g. ``name("rollouts") == "rl.rollouts"``."""
        spec = getattr(self, role) if role in ("lease", "job") else self.specs()[role]
        return self.prefix + spec.name


class RLConfig(StrictModel):
    """Values several roles must agree on (each role reads them here, never in another role's section)."""

    max_staleness: int = Field(1, ge=0, le=1000)
    """k: a sample generated by version v may train version v' only if v' - v <= k. 0 = synchronous."""
    staleness_rule: Literal["sample", "token"] = "sample"
    """The hard staleness bound at trainer version v. ``sample``: a sample with ``v - version_min > k``
    is dropped whole. ``token``: per token, using the record's ``metadata["versions"]`` marks
    (partial rollouts resumed across weight loads): tokens generated by a version older than
    ``v - k`` are masked out of the loss, the rest train with their own behaviour logprobs; a sample
    with no trainable token left is dropped as stale. No token older than k versions is ever trained
    either way (docs/reference/trainer.md, docs/reference/losses.md). The trainer applies it; the rollout workers read
    it to decide what a stale restart keeps. Formerly ``trainer.staleness_rule``."""
    replicate: int = Field(1, ge=1, le=4096)
    """Prompt replication: the feed splits each group's n samples over this many messages on
    distinct partitions; the rollout workers size their admission by it (samples per message).
    Formerly ``feed.replicate``."""
    group_size: int = Field(8, ge=1, le=4096)
    """n: samples per prompt (GRPO group)."""
    groups_per_step: int = Field(4, ge=1)
    """Complete groups per optimizer step."""

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.groups_per_step


class LivenessConfig(StrictModel):
    """How every role stays alive or dies loudly (``pipeline.worker``). A role that breaks one of
    these bounds dumps every thread's stack to its log and exits non-zero, so a supervisor
    restarts it (restarts are safe by design)."""

    watchdog_s: float = Field(120.0, ge=5, le=86_400)
    """Longest one iteration of a role's main loop may take (a hung Kafka call is caught here)."""
    slow_op_s: float = Field(1800.0, ge=5, le=7 * 86_400)
    """Longest a declared long operation may take: loading a model or weights, a training step,
    scoring one batch, writing a checkpoint."""
    shutdown_timeout_s: float = Field(30.0, ge=1, le=3600)
    """After SIGTERM/SIGINT a role finishes what it holds and exits within this; a second signal exits at once."""
    startup_timeout_s: float = Field(300.0, ge=1, le=86_400)
    """Start-up retries transient Kafka errors (broker unreachable, metadata not ready, coordinator
    loading, topic not created yet) with backoff for this long, then fails with a clear message."""
    outage_s: float = Field(300.0, ge=1, le=86_400)
    """A broker outage shorter than this is ridden out: produce/flush/commit wait and retry."""
    disk_full_timeout_s: float = Field(1800.0, ge=0, le=30 * 86_400)
    """How long a role pauses on a full disk (``ENOSPC``) under the weights store or its checkpoint
    dir before it gives up and exits non-zero. While paused it says ``disk full at <dir> (need N MB
    free, M MB left); paused`` on screen, keeps its place (nothing is committed for the write that
    failed, half-written files are removed, the previous weights stay live) and resumes by itself
    within a second of space being freed. 0 = pause as long as it takes."""
    store_slow_s: float = Field(30.0, ge=1, le=86_400)
    """A write to the weights store or a checkpoint dir still running after this long is said on
    screen (``weights store slow: ...``) until it ends; ``slow_op_s`` still bounds it. A store that
    fails (I/O errors, timeouts) is retried with backoff for ``outage_s``, also said on screen."""
    broker_check_s: float = Field(5.0, ge=0, le=3600)
    """A command run by hand (not by rlstream's supervisor) first checks that a broker answers
    within this long and, if none does, stops with one line and exit code 2. 0 = no check: the
    command then waits for the cluster up to ``startup_timeout_s`` like a supervised role (for
    deployments that start roles before the cluster is up, e.g. plain Kubernetes pods)."""
    stall_s: float = Field(300.0, ge=0, le=7 * 86_400)
    """``rlstream run``/``demo`` stop the job (``failed: stalled: ...``, exit non-zero) when the
    trainer has made no step for this long, counted from the start or its last step, while dead
    letters arrived in that time: work is being thrown away and nothing trains (a reward function
    that raises, a dataset the rollout workers cannot use). Without dead letters a slow step is
    never stopped; the stage that makes no progress is named on screen either way. 0 = off."""


RENAMED: dict[str, str] = {
    "trainer.staleness_rule": "rl.staleness_rule",
    "feed.replicate": "rl.replicate",
}
"""Deprecated key -> its new key (``move_renamed``): values several roles read moved to ``rl``."""


# ---- loading ------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """Parse a CLI/env value as a TOML literal, falling back to the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict, dotted: str, value: Any, source: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"{source}: empty key")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(parts)}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def _lookup(tree: dict, parts: list[str]) -> tuple[dict | None, Any]:
    """(the table holding the key, its value); (None, None) where the key is unset."""
    node = tree
    for p in parts[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
    if isinstance(node, dict) and parts[-1] in node:
        return node, node[parts[-1]]
    return None, None


def move_renamed(tree: dict, source: str = "config", renamed: Mapping[str, str] = RENAMED) -> dict:
    """Move each deprecated key of one layer's raw ``tree`` onto its new key, with a FutureWarning
    naming the new key; ConfigError (naming both) where the layer sets both to different values.
    Returns the tree with the new keys (a copy where it moved one; ``tree`` is not changed)."""
    if all(_lookup(tree, old.split("."))[0] is None for old in renamed):
        return tree
    tree = copy.deepcopy(tree)
    for old, new in renamed.items():
        table, value = _lookup(tree, old.split("."))
        if table is None:
            continue
        del table[old.split(".")[-1]]
        _, current = _lookup(tree, new.split("."))
        if current is not None and current != value:
            raise ConfigError(
                f"{source}: {old} = {value!r} (deprecated) and {new} = {current!r} disagree: set only {new}"
            )
        # shown as "<source>:0: FutureWarning: ...": where the old key was given, not this line
        warnings.warn_explicit(f"{old} is deprecated, use {new} (read as {new} = {value!r})", FutureWarning, source, 0)
        _set_path(tree, new, value, source)
    return tree


def merge(base: dict, new: dict) -> dict:
    """Deep-merge ``new`` into ``base`` (tables merge, other values replace)."""
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
    return base


def env_overrides(environ: dict[str, str] | None = None) -> dict:
    environ = os.environ if environ is None else environ
    tree: dict = {}
    for key, val in environ.items():
        if not key.startswith(ENV_PREFIX) or key[len(ENV_PREFIX) :] in NON_CONFIG_ENV:
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_path(tree, dotted, parse_value(val), f"environment {key}")
    return move_renamed(tree, "environment")


def cli_overrides(items: list[str] | None) -> dict:
    tree: dict = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. rl.max_staleness=2")
        key, _, val = item.partition("=")
        _set_path(tree, key.strip(), parse_value(val.strip()), f"--set {item!r}")
    return move_renamed(tree, "--set")


def settings_tree(settings: Mapping[str, Any] | None, source: str = "settings") -> dict:
    """Typed overrides, dotted key -> Python value (``{"trainer.max_steps": 10, "model": {...}}``),
    as a raw tree to merge: what code composes instead of ``--set`` strings (no parsing)."""
    tree: dict = {}
    for key, value in (settings or {}).items():
        _set_path(tree, key, value, f"{source} {key!r}")
    return move_renamed(tree, source)


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return move_renamed(tomllib.loads(p.read_text()), str(p))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from exc


def load_tree(
    path: str | Path | None,
    overrides: list[str] | None,
    environ: dict[str, str],
    settings: Mapping[str, Any] | None = None,
) -> dict:
    """The raw settings of file < environment < overrides (``--set``) < ``settings`` (typed, from
    code: a command's own flags), before validation."""
    tree = read_toml(path) if path else {}
    merge(tree, env_overrides(environ))
    merge(tree, cli_overrides(overrides))
    merge(tree, settings_tree(settings))
    return tree


def fill_union_types(tree: dict, default: StrictModel) -> None:
    """A partial table for a discriminated union (``[model]``, ``[rollout.engine]``) that names no
    ``type`` keeps the default's type, so ``--set model.hidden_size=64`` just works."""
    for key, value in tree.items():
        sub = getattr(default, key, None) if isinstance(default, StrictModel) else None
        if not isinstance(value, dict) or not isinstance(sub, StrictModel):
            continue
        if "type" in type(sub).model_fields and "type" not in value:
            value["type"] = sub.type
        if value.get("type", getattr(sub, "type", None)) == getattr(sub, "type", None):
            fill_union_types(value, sub)


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        # a check across sections (no location) names its keys in its own message
        lines.append(f"{key}: {msg}" if key else msg.removeprefix("Value error, "))
    return "invalid configuration:\n  " + "\n  ".join(lines)


def validate(model: type[StrictModel], tree: dict):
    """``model.model_validate(tree)``; a ValidationError becomes a ConfigError naming every bad key."""
    fill_union_types(tree, model())
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def with_settings(cfg: StrictModel, settings: Mapping[str, Any]) -> StrictModel:
    """A copy of the validated ``cfg`` with typed ``settings`` (dotted key -> value) applied and
    validated again (ConfigError naming a bad key); ``cfg`` is not changed."""
    tree = tomllib.loads(dump_toml(cfg))
    return validate(type(cfg), merge(tree, settings_tree(settings)))


# ---- writing ------------------------------------------------------------------------------


_SECRET = re.compile(r"(password|secret|api_key|(^|[._])token)$|password|secret", re.IGNORECASE)
"""Settings whose values never go into a resolved-config file (and every value of ``users``)."""


def write_resolved(cfg: StrictModel, run_dir: str | Path, name: str) -> Path:
    """Write the resolved config to ``<run_dir>/<name>.resolved.toml`` (every role at start-up),
    with secrets (passwords, keys, tokens) redacted."""
    path = Path(run_dir) / f"{name}.resolved.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(cfg, redact=True))
    return path


def dump_toml(cfg: StrictModel, redact: bool = False) -> str:
    """A config as TOML (round-trips through ``validate`` unless ``redact``)."""
    return _model_toml(cfg, "", redact).strip() + "\n"


def _secret(key: str) -> bool:
    return bool(_SECRET.search(key))


def _redacted(name: str, value):
    if isinstance(value, dict):
        return {k: "<redacted>" if name == "users" or _secret(k) else _redacted(k, v) for k, v in value.items()}
    return "<redacted>" if _secret(name) and value else value


def _model_toml(model: StrictModel, prefix: str, redact: bool = False) -> str:
    scalars, tables = [], []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, StrictModel):
            tables.append((name, value))
        elif (
            value is None
            and field.get_default(call_default_factory=True) is not None
            and _takes_none_not_str(field.annotation)
        ):
            scalars.append(f'{name} = "{NONE}"')  # TOML has no null: left out, it would read back as the default
        elif value is not None:
            dumped = model.model_dump(mode="json", include={name})[name]
            scalars.append(f"{name} = {_toml_value(_redacted(name, dumped) if redact else dumped)}")
    out = "\n".join(scalars) + "\n"
    for name, sub in tables:
        out += f"\n[{prefix}{name}]\n" + _model_toml(sub, f"{prefix}{name}.", redact)
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        items = (f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None)
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
