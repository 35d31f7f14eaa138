"""The root configuration of rlstream and how it is loaded.

Sources, later ones win: defaults < TOML file (``--config`` or ``RLSTREAM_CONFIG``) <
environment (``RLSTREAM_SECTION__KEY=value``) < CLI overrides (``--set section.key=value``).
Values from the environment and ``--set`` are parsed as TOML literals when they parse
(``3``, ``true``, ``[1, 2]``), otherwise taken as strings. Any error names the bad key.

Role configs live with their roles (``producers.config``, ``consumers.*.config``); this module
only assembles them and cross-checks the values several roles share.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from consumers.reward.config import RewardConfig
from consumers.trainer.config import TrainerConfig
from pipeline.configbase import StrictModel
from pipeline.errors import ConfigError
from pipeline.models import ModelConfig, TinyModelConfig
from producers.config import FeedConfig, RolloutConfig

ENV_PREFIX = "RLSTREAM_"
DEFAULT_HOME = Path(os.environ.get("RLSTREAM_HOME", Path.home() / ".rlstream"))


class KafkaConfig(StrictModel):
    bootstrap_servers: str | None = None
    """host:port list. None: the local broker's recorded address if it runs, else 127.0.0.1:9092."""
    client_id_prefix: str = "rlstream"
    """Prefix of every client.id, followed by role and worker id."""
    producer: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra librdkafka producer settings (e.g. linger.ms, compression.type)."""
    consumer: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra librdkafka consumer settings."""
    common: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra librdkafka settings for every client (security.protocol, sasl.*, ...)."""
    request_timeout_s: float = Field(30.0, gt=0)
    """Timeout of admin calls and flushes."""


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
    replication_factor: int = Field(1, ge=1)
    """Default replication factor (3 on a production cluster)."""
    prompts: TopicSpec = TopicSpec(name="prompts", partitions=8)
    rollouts: TopicSpec = TopicSpec(name="rollouts", partitions=8)
    scored: TopicSpec = TopicSpec(name="scored", partitions=4)
    control: TopicSpec = TopicSpec(name="control", partitions=1, retention_ms=-1)
    metrics: TopicSpec = TopicSpec(name="metrics", partitions=1, retention_ms=24 * 3600 * 1000)
    dlq: TopicSpec = TopicSpec(name="dlq", partitions=1, retention_ms=-1)

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
        return self

    def specs(self) -> dict[str, TopicSpec]:
        """Role name -> spec, in a stable order."""
        return {k: getattr(self, k) for k in ("prompts", "rollouts", "scored", "control", "metrics", "dlq")}

    def name(self, role: str) -> str:
        """Full topic name of a role, e.g. ``name("rollouts") == "rl.rollouts"``."""
        return self.prefix + self.specs()[role].name


class BrokerConfig(StrictModel):
    port: int = Field(9092, ge=0, le=65535)
    """Client port of the local broker; 0 picks a free one."""
    host: str = "127.0.0.1"
    """Address the local broker listens on."""
    data_dir: Path = DEFAULT_HOME / "broker"
    """Holds the log dirs, server.properties, the pidfile and broker.log."""
    heap_mb: int = Field(768, ge=256, le=65536)
    """JVM heap of the local broker."""
    start_timeout_s: float = Field(120.0, gt=0)
    """How long `broker start` waits for the broker to accept connections."""
    properties: dict[str, str] = Field(default_factory=dict)
    """Extra server.properties entries, overriding the built-in ones."""


class RLConfig(StrictModel):
    """Values several roles must agree on."""

    max_staleness: int = Field(1, ge=0, le=1000)
    """k: a sample generated by version v may train version v' only if v' - v <= k. 0 = synchronous."""
    group_size: int = Field(8, ge=1, le=4096)
    """n: samples per prompt (GRPO group)."""
    groups_per_step: int = Field(4, ge=1)
    """Complete groups per optimizer step."""

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.groups_per_step


class Config(StrictModel):
    kafka: KafkaConfig = KafkaConfig()
    topics: TopicsConfig = TopicsConfig()
    broker: BrokerConfig = BrokerConfig()
    rl: RLConfig = RLConfig()
    model: ModelConfig = TinyModelConfig()
    """The policy: ``type = "tiny"`` (random init, built in code) or ``type = "pretrained"``."""
    checkpoint_store: str = ""
    """fsspec URI where the trainer publishes weights; empty: ``<run_dir>/checkpoints``."""
    feed: FeedConfig = FeedConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Standard-library logging level of every role."""
    run_dir: Path = Path("runs")
    """Where roles write resolved configs, reports and checkpoints by default."""

    @property
    def store(self) -> str:
        return self.checkpoint_store or str(Path(self.run_dir).resolve() / "checkpoints")

    @model_validator(mode="after")
    def _cross_check(self):
        for role, spec in self.topics.specs().items():
            broker_max = int(self.broker.properties.get("message.max.bytes", 16 * 1024 * 1024))
            if spec.max_message_bytes > broker_max:
                raise ValueError(
                    f"topics.{role}.max_message_bytes={spec.max_message_bytes} exceeds the broker's "
                    f"message.max.bytes={broker_max}"
                )
        return self


# ---- loading ------------------------------------------------------------------------------


def write_resolved(cfg: Config, name: str) -> Path:
    """Write the resolved config to ``<run_dir>/<name>.resolved.toml`` (every role at start-up)."""
    path = Path(cfg.run_dir) / f"{name}.resolved.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(cfg))
    return path


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


def _merge(base: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def env_overrides(environ: dict[str, str] | None = None) -> dict:
    environ = os.environ if environ is None else environ
    tree: dict = {}
    for key, val in environ.items():
        if not key.startswith(ENV_PREFIX) or key in ("RLSTREAM_CONFIG", "RLSTREAM_HOME"):
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_path(tree, dotted, parse_value(val), f"environment {key}")
    return tree


def cli_overrides(items: list[str] | None) -> dict:
    tree: dict = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. rl.max_staleness=2")
        key, _, val = item.partition("=")
        _set_path(tree, key.strip(), parse_value(val.strip()), f"--set {item!r}")
    return tree


def _fill_union_types(tree: dict, default: StrictModel) -> None:
    """A partial table for a discriminated union (``[model]``, ``[rollout.engine]``) that names no
    ``type`` keeps the default's type, so ``--set model.hidden_size=64`` just works."""
    for key, value in tree.items():
        sub = getattr(default, key, None) if isinstance(default, StrictModel) else None
        if not isinstance(value, dict) or not isinstance(sub, StrictModel):
            continue
        if "type" in type(sub).model_fields and "type" not in value:
            value["type"] = sub.type
        if value.get("type", getattr(sub, "type", None)) == getattr(sub, "type", None):
            _fill_union_types(value, sub)


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{key}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Resolve the configuration from file, environment and overrides. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("RLSTREAM_CONFIG")
    tree: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
    _merge(tree, env_overrides(environ))
    _merge(tree, cli_overrides(overrides))
    _fill_union_types(tree, Config())
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def dump_toml(cfg: StrictModel) -> str:
    """The resolved config as TOML (written at start-up by every role)."""
    return _model_toml(cfg, "").strip() + "\n"


def _model_toml(model: StrictModel, prefix: str) -> str:
    scalars, tables = [], []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, StrictModel):
            tables.append((name, value))
        elif value is not None:
            dumped = model.model_dump(mode="json", include={name})[name]
            scalars.append(f"{name} = {_toml_value(dumped)}")
    out = "\n".join(scalars) + "\n"
    for name, sub in tables:
        out += f"\n[{prefix}{name}]\n" + _model_toml(sub, f"{prefix}{name}.")
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
