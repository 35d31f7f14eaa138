"""The root configuration of rlstream: the shared sections of the core plus every role's section,
and the local dev broker's settings. Loading rules are ``pipeline.config``'s: defaults < TOML
file (``--config`` or ``RLSTREAM_CONFIG``) < ``RLSTREAM_SECTION__KEY`` environment < ``--set``.

This is the application layer: it may import the roles' config sections; no role imports it.
Roles receive the resolved root ``Config`` and read ``kafka``, ``topics``, ``rl``, ``liveness``,
``model``, ``store`` and their own section.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from consumers.eval.worker import EvalConfig
from consumers.reward.config import RewardConfig
from consumers.tracking.worker import TrackingConfig
from consumers.trainer.config import TrainerConfig
from pipeline.config import (
    DEFAULT_HOME,
    KafkaConfig,
    LivenessConfig,
    RLConfig,
    StrictModel,
    TopicsConfig,
    load_tree,
    move_renamed,
    validate,
)
from pipeline.kafka import DEFAULT_BOOTSTRAP, check_reachable, client_conf
from pipeline.models import ModelConfig, TinyModelConfig
from producers.config import FeedConfig, RolloutConfig
from rlstream.lease import LeaseConfig

BROKER_JVM_OPTIONS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:TieredStopAtLevel=1")
"""The local broker's default ``broker.jvm_options``."""


class BrokerConfig(StrictModel):
    """The local KRaft broker of ``rlstream broker`` (development and tests; no Docker needed)."""

    port: int = Field(9092, ge=0, le=65535)
    """Client port of the local broker; 0 picks a free one."""
    host: str = "127.0.0.1"
    """Address the local broker listens on."""
    data_dir: Path = DEFAULT_HOME / "broker"
    """Holds the log dirs, server.properties, the pidfile and broker.log."""
    heap_mb: int = Field(768, ge=256, le=65536)
    """JVM heap of the local broker."""
    jvm_options: list[str] = Field(default_factory=lambda: list(BROKER_JVM_OPTIONS), max_length=64)
    """Options of the broker's ``java`` command (the heap is ``heap_mb``). The default compiles
    with the JVM's quick compiler only (``-XX:TieredStopAtLevel=1``): a new broker reaches its
    speed within seconds and spends about half the CPU of a full JIT on a job's first minutes, which
    is what a workstation or a small node feels (docs/results/performance.md). For a long-lived
    broker under heavy load, drop that option to let the optimising compiler in."""
    start_timeout_s: float = Field(120.0, gt=0)
    """How long `broker start` waits for the broker to accept connections."""
    nodes: int = Field(1, ge=1, le=9)
    """Kafka nodes of the local broker (``rlstream broker start --nodes N``). 1: one combined-mode
    node in ``data_dir``. Above 1: a local cluster of N combined-mode (broker + controller) nodes
    in ``data_dir/node-<i>``, internal topics and new topics with min(3, N) replicas and
    ``min.insync.replicas`` min(2, N): for fault tests (kill, pause, restart one node), not
    production (docs/how-to/multi-machine.md). ``security = "sasl_ssl"`` needs 1."""
    properties: dict[str, str] = Field(default_factory=dict)
    """Extra server.properties entries, overriding the built-in ones."""
    security: Literal["plaintext", "sasl_ssl"] = "plaintext"
    """``plaintext``: no authentication, no TLS, no ACLs. ``sasl_ssl``: one SASL_SSL listener
    (SCRAM-SHA-512 over TLS with a CA generated in ``data_dir/tls``), ACLs enforced (nothing is
    allowed without one) and ``users.admin`` as the super user (docs/how-to/security.md). Fixed when the
    data dir is first formatted."""
    users: dict[str, str] = Field(default_factory=dict, max_length=1000)
    """SCRAM-SHA-512 users of the ``sasl_ssl`` broker, name -> password (``admin`` is required:
    the super user the broker itself and ``topics create`` use). Created when the data dir is
    formatted; users added or passwords changed later are applied at the next start (except
    admin's). Names: letters, digits, ``._-``; passwords: 8-256 characters without ``,`` ``"``
    ``\\`` or whitespace. Plain text in the config: fine for a development broker only."""

    @model_validator(mode="after")
    def _check_users(self):
        for name, password in self.users.items():
            if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", name):
                raise ValueError(f"broker.users: user name {name!r} must be 1-128 of letters, digits, '.', '_', '-'")
            if not re.fullmatch(r'[^,"\\\s]{8,256}', password):
                raise ValueError(
                    f"broker.users.{name}: the password must be 8-256 characters without ',', '\"', '\\' or whitespace"
                )
        for opt in self.jvm_options:
            if not opt.startswith("-"):
                raise ValueError(f"broker.jvm_options: {opt!r} is not a java option (options start with '-')")
            if opt.startswith(("-Xmx", "-Xms")):
                raise ValueError(f"broker.jvm_options: {opt!r} sets the heap; set broker.heap_mb instead")
        if self.security == "sasl_ssl" and self.nodes > 1:
            raise ValueError('broker.security = "sasl_ssl" works with broker.nodes = 1 only (for now)')
        if self.security == "sasl_ssl" and "admin" not in self.users:
            raise ValueError('broker.security = "sasl_ssl" needs broker.users.admin (the super user)')
        return self


class DatasetConfig(StrictModel):
    generator: str = Field(min_length=1)
    """A built-in task generator of ``rlstream.tasks``: next_digit, arithmetic, guess_number, textarena, reasoning_gym."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the generator."""
    held_out: float = Field(0.0, ge=0.0, le=0.9)
    """Share of the generated records kept out of training, as the eval set (``eval.source``); a
    generator with its own held-out split (reasoning_gym: another seed) ignores it."""


class JobConfig(StrictModel):
    name: str = Field("", pattern=r"^[A-Za-z0-9._-]*$")
    """The job's name: fixes its topic prefix (``<name>.``), consumer groups (``<name>-<role>``) and
    run dir (``<run_dir>/<name>``), so running it again resumes it. '' = the job file's name
    without ``.toml``."""
    rollout_workers: int = Field(2, ge=1, le=256)
    """Rollout worker processes."""
    reward_workers: int = Field(2, ge=1, le=256)
    """Reward worker processes."""
    trainer_standby: bool = False
    """Run a hot-standby trainer beside the trainer (``trainer-standby``, ``trainer.standby``): it
    imports everything and waits on the checkpoint dir's lock, and takes over the moment the
    trainer dies, so a trainer crash costs a checkpoint restore instead of a process start. Costs
    one idle process (its imports' memory; it loads the model only when it takes over)."""
    rollout_standby: bool = False
    """Run a warm spare rollout worker (``rollout-spare``) and the rollout workers as static members
    by slot (``rollout.slots``, ``producers.slots``): the spare builds its engine, follows the weights
    and takes the slot of a worker that dies, partitions included, with no rebalance and no session
    timeout. Costs one more process with the model loaded; a worker's clean stop also waits for the
    spare (or its restart) to take its partitions over."""
    fork_server: bool = True
    """Start the roles by forking them from one process that has imported torch, transformers, the
    role modules and the model's code once (``rlstream.forkserver``), instead of each role importing
    them again: on a small machine the first step comes seconds sooner, and a restarted role is
    back at once. Linux only; anything wrong with it falls back to plain processes. false = one
    fresh ``python -m rlstream`` process per role."""
    eval: bool = False
    """Run ``rlstream eval`` beside the pipeline (needs ``eval.source`` or ``dataset.held_out``)."""
    export: bool = True
    """When the run finishes ok, export the final version to ``<run dir>/export/final`` and the best
    one by held-out eval (``eval.best_metric``, with ``eval = true``) to ``<run dir>/export/best``,
    as Hugging Face model directories (``rlstream export``; a LoRA version's adapter directory is
    copied as it is). false = export nothing."""
    dataset: DatasetConfig | None = None
    """Generate the training data with a built-in generator instead of ``feed.source``."""
    memory_limit_mb: dict[Literal["feed", "rollout", "reward", "train", "eval"], int] = {}
    """Run each role of that kind under a memory limit in MB, e.g. ``{reward = 2000, rollout =
    12000}``: a memory cgroup of its own where the machine allows one (Linux, cgroup v1 or v2, with
    permission), over which the kernel's OOM killer kills it; else RLIMIT_AS (address space, which
    counts more than memory: give a larger limit). The launcher says ``reward-0 was killed by the
    kernel's OOM killer (memory limit 2000 MB); restarting`` and restarts it like any dead role.
    Empty (the default): no limit."""
    metrics_port_base: int = Field(0, ge=0, le=65000)
    """Serve Prometheus /metrics: rollout-i on base+i, reward-i on base+10+i, trainer on base+20,
    eval on base+30 (blocks of 10 ports; wider blocks, of the larger worker count, beyond 10 workers
    of a kind: ``rlstream.launcher.metrics_port``); the launcher also writes Prometheus file-based
    discovery targets (0 = off)."""

    @model_validator(mode="after")
    def _ports_fit(self):
        if small := {k: v for k, v in self.memory_limit_mb.items() if not 64 <= v <= 16_777_216}:
            raise ValueError(f"job.memory_limit_mb: {small}: each limit must be from 64 to 16777216 MB")
        if self.metrics_port_base:
            top = self.metrics_port_base + 4 * max(10, self.rollout_workers, self.reward_workers) - 1
            if top > 65535:
                raise ValueError(
                    f"job.metrics_port_base={self.metrics_port_base}: the ports would reach {top} (> 65535)"
                )
        return self


class Config(StrictModel):
    kafka: KafkaConfig = KafkaConfig()
    topics: TopicsConfig = TopicsConfig()
    broker: BrokerConfig = BrokerConfig()
    rl: RLConfig = RLConfig()
    liveness: LivenessConfig = LivenessConfig()
    """Watchdog, bounded shutdown, start-up retries and outage riding of every role."""
    model: ModelConfig = TinyModelConfig()
    """The policy: ``type = "tiny"`` (random init, built in code) or ``type = "pretrained"``."""
    checkpoint_store: str = ""
    """fsspec URI where the trainer publishes weights; empty: ``<run_dir>/checkpoints``."""
    feed: FeedConfig = FeedConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    """Evaluation while training (``rlstream eval``): a held-out dataset, scored every N versions."""
    tracking: TrackingConfig = TrackingConfig()
    """Experiment logging of rl.metrics: TensorBoard event files, W&B."""
    job: JobConfig = JobConfig()
    """``rlstream run``: the job's name, worker counts, eval, generated data (rlstream.job)."""
    lease: LeaseConfig = LeaseConfig()
    """The launcher's job lease in Kafka: one run per job (rlstream.lease)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Standard-library logging level of every role."""
    run_dir: Path = Path("runs")
    """Where roles write resolved configs, reports and checkpoints by default."""

    @property
    def store(self) -> str:
        return self.checkpoint_store or str(Path(self.run_dir).resolve() / "checkpoints")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        """Deprecated keys (``pipeline.config.RENAMED``) in a tree given whole (``rlstream.Job``'s
        dict, a merged preset): the loaders have already moved those of each layer."""
        return move_renamed(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _cross_check(self):
        broker_max = int(self.broker.properties.get("message.max.bytes", 16 * 1024 * 1024))
        for role, spec in self.topics.specs().items():
            if spec.max_message_bytes > broker_max:
                raise ValueError(
                    f"topics.{role}.max_message_bytes={spec.max_message_bytes} exceeds the broker's "
                    f"message.max.bytes={broker_max}"
                )
        if self.rollout.overprovision and self.rl.replicate > 1:
            raise ValueError(
                f"rollout.overprovision={self.rollout.overprovision} needs every group in one prompt message, "
                f"but rl.replicate={self.rl.replicate} splits it over {self.rl.replicate}"
            )
        if self.rollout.overprovision_tail == "train" and not self.rollout.overprovision:
            raise ValueError(
                "rollout.overprovision_tail='train' trains the extra samples rollout.overprovision draws, "
                "but rollout.overprovision=0 draws none: set rollout.overprovision (1-2 for a group of 8)"
            )
        return self


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    environ: dict[str, str] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> Config:
    """Resolve the configuration from file, environment, ``--set`` overrides and typed ``settings``
    (dotted key -> value, the top layer: what code sets). Raises ConfigError."""
    environ = os.environ if environ is None else environ
    return validate(Config, load_tree(path or environ.get("RLSTREAM_CONFIG"), overrides, environ, settings))


def resolve_bootstrap(cfg: Config) -> str:
    """Fix ``kafka.bootstrap_servers`` once, at start-up: the configured address, else the running
    local broker's recorded one, else the default (the docker-compose broker)."""
    if not cfg.kafka.bootstrap_servers:
        from rlstream.broker import read_broker_state

        state = read_broker_state(Path(cfg.broker.data_dir))
        cfg.kafka.bootstrap_servers = (state or {}).get("bootstrap") or DEFAULT_BOOTSTRAP
    return cfg.kafka.bootstrap_servers


START_A_BROKER = (
    "start one with `rlstream broker start`, or set kafka.bootstrap_servers (-s kafka.bootstrap_servers=HOST:PORT)"
)


def require_broker(cfg: Config, bootstrap: str | None = None) -> None:
    """For a command run by hand, before its work starts: BrokerUnreachable (one line, with the
    address tried and how to start a broker) when no broker at ``bootstrap`` (default
    ``kafka.bootstrap_servers``) answers within ``liveness.broker_check_s``; 0 skips the check.
    Roles under rlstream's supervisor never call this: they retry for ``startup_timeout_s``."""
    if cfg.liveness.broker_check_s <= 0:
        return
    conf = client_conf(cfg, "cli")
    if bootstrap:
        conf["bootstrap.servers"] = bootstrap
    check_reachable(conf, cfg.liveness.broker_check_s, START_A_BROKER)


def record_job_dir(cfg: Config, job_file: str | Path | None) -> None:
    """Add the job file's directory to ``reward.import_dirs`` and ``rollout.env.import_dirs``: a
    reward or environment module kept beside the job file is then found by the job's roles, and by
    roles started by hand with the run's config.toml."""
    if job_file is None:
        return
    where = Path(job_file).resolve().parent
    for section in (cfg.reward, cfg.rollout.env):
        if where not in [Path(d).resolve() for d in section.import_dirs]:
            section.import_dirs = [*section.import_dirs, where]
