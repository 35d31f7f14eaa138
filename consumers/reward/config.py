"""Configuration of the reward workers: the consumer group and transactions, batching, the scoring
pool, which reward functions score which task, sandbox limits and metrics.

Only validation lives here; the worker (``consumers.reward.worker``) interprets the values.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.config import StrictModel
from pipeline.topology import DEFAULT as DEFAULT_IDENTITY


class RewardSpec(StrictModel):
    """One reward function in a weighted sum."""

    name: str = Field(min_length=1)
    """A built-in (exact_match, regex, format, math, code, http, openai_judge) or ``module:function``."""
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    """Multiplies this function's reward before the terms are summed."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the built-in's factory, or extra keyword arguments of ``module:function``."""


class SandboxConfig(StrictModel):
    """Default limits of the code-execution sandbox (the ``code`` reward may override them)."""

    wall_s: float = Field(5.0, gt=0, le=600)
    """Wall-time limit of one program run (one test case)."""
    cpu_s: int = Field(2, ge=1, le=600)
    """RLIMIT_CPU of the program, seconds."""
    memory_mb: int = Field(512, ge=32, le=65536)
    """RLIMIT_AS of the program (address space), MiB."""
    max_processes: int = Field(16, ge=1, le=4096)
    """RLIMIT_NPROC: processes (and threads) the program may have at once."""
    max_output_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Largest stdout (and stderr) kept; a program that writes more is killed and fails."""
    max_open_files: int = Field(64, ge=16, le=65536)
    """RLIMIT_NOFILE of the program."""
    network: Literal["deny", "allow"] = "deny"
    """deny: run the program in a new, empty network namespace where the OS allows it."""
    require_isolation: bool = False
    """True: fail the run (setup error) when network isolation, the uid drop or (for isolation =
    "auto") bubblewrap is unavailable."""
    uid_base: int = Field(200_000, ge=1000, le=4_000_000_000)
    """As root, programs run as uid ``uid_base + pid of the scoring process`` (unique, no login)."""
    python: str | None = None
    """Interpreter that runs the programs. None: the worker's own."""
    python_flags: list[str] = Field(default_factory=lambda: ["-I"])
    """Flags given to that interpreter (``-I``: isolated mode)."""
    isolation: Literal["auto", "bwrap", "namespaces"] = "auto"
    """auto: bubblewrap (new user/pid/net/ipc/uts namespaces, seccomp filter, read-only minimal
    filesystem with a private work dir) when it works here, else a loud fallback to namespaces
    (a warning, and ``fallback`` in each run's isolation details; with require_isolation the run
    fails instead). bwrap: bubblewrap or fail. namespaces: rlimits, a network namespace and the uid
    drop only (no seccomp, host filesystem readable)."""
    seccomp: bool = True
    """Under bubblewrap, load the seccomp filter (``consumers.reward.seccomp``; needs libseccomp)."""
    bwrap: str = Field("bwrap", min_length=1)
    """The bubblewrap executable: a name looked up on PATH, or a path."""
    cgroup_parent: str | None = Field(None, pattern=r"^/")
    """An absolute cgroup v2 directory, writable, with memory and pids in its ``cgroup.subtree_control``;
    each run gets a child cgroup there with memory.max = memory_mb, pids.max and no swap. None:
    the worker's own cgroup if it qualifies, else these limits are off (logged once)."""


class RewardConfig(StrictModel):
    group_id: str = DEFAULT_IDENTITY.group("reward")
    """Consumer group of the reward workers (``rlstream-reward``; ``rlstream run`` names it after
    the job: ``pipeline.topology.RunIdentity``)."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-time limit of one reward call (all terms for one trajectory); past it -> DLQ reward_timeout."""
    worker_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")
    """This worker's id. None: ``<hostname>-<pid>``. Keep it stable across restarts so the
    transactional id (and with it zombie fencing) carries over."""
    group_instance_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")
    """Static membership (``group.instance.id``): a restart within the session timeout keeps the
    partitions without a rebalance. None: dynamic membership."""
    transactional_id_prefix: str = Field(DEFAULT_IDENTITY.transactional_id_prefix, pattern=r"^[A-Za-z0-9._-]+$")
    """The worker's ``transactional.id`` is ``<prefix>-<worker_id>`` (``pipeline.topology.transactional_id``)."""
    max_batch_size: int = Field(32, ge=1, le=100_000)
    """Most rollouts scored and committed in one transaction."""
    max_batch_ms: int = Field(500, ge=1, le=600_000)
    """Longest a batch waits to fill once its first message arrived."""
    batch_idle_ms: int = Field(20, ge=0, le=600_000)
    """Close a batch early once this long passed with no new message (0: always wait max_batch_ms).
    A lightly loaded stage then adds about this much to a step instead of max_batch_ms; under load
    messages keep arriving and batches still fill."""
    overlap_commit: bool = False
    """Send batch N's offsets and commit its transaction on a commit thread while batch N+1 is read
    and scored (transaction N+1 begins once N has committed; a rebalance waits for the commit).
    Exactly once either way; false commits each batch before reading the next."""
    idle_poll_s: float = Field(0.5, gt=0, le=60)
    """How long one poll waits for a first message when idle."""
    transaction_timeout_ms: int = Field(60_000, ge=1000, le=900_000)
    """``transaction.timeout.ms``: the broker aborts a transaction left open this long."""
    session_timeout_ms: int = Field(45_000, ge=1000, le=3_600_000)
    """``session.timeout.ms`` of the group (the broker's minimum is usually 6000)."""
    max_poll_interval_ms: int = Field(600_000, ge=1000, le=86_400_000)
    """``max.poll.interval.ms``; must exceed the worst-case time to score one batch."""
    executor: Literal["process", "thread"] = "process"
    """process: a pool of processes (CPU-bound verifiers; a hung call is killed). thread: threads
    in the worker (cheap rewards; a hung call is abandoned, not killed)."""
    pool_size: int = Field(2, ge=1, le=1024)
    """Processes (or threads) scoring in parallel."""
    default: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="exact_match")])
    """Reward for tasks not in ``tasks``: weighted sum of these. Empty: such tasks go to the DLQ."""
    tasks: dict[str, list[RewardSpec]] = Field(default_factory=dict)
    """Task name -> weighted sum of reward functions for that task."""
    import_dirs: list[Path] = Field(default_factory=list, max_length=64)
    """Directories where the module of a ``module:function`` reward is looked up first (by name;
    sys.path is not changed), then the import path (PYTHONPATH). ``rlstream run`` adds the job
    file's directory, so a reward module kept beside the job file is found by the job's roles and
    by roles started by hand with the run's config.toml. Relative paths are taken from the
    working directory."""
    sandbox: SandboxConfig = SandboxConfig()
    """Limits of the code-execution sandbox."""
    metrics_interval_s: float = Field(10.0, gt=0, le=3600)
    """How often a MetricEvent goes to the metrics topic."""
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus /metrics on this port; 0 = disabled."""
    reward_buckets: list[float] = Field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], max_length=32)
    """Upper bounds of the per-task reward histogram (counts of rewards <= bound)."""
    chaos_delay_in_txn_ms: int = Field(0, ge=0, le=60_000)
    """Fault-injection knob for tests: sleep this long inside each transaction, after producing and
    before committing. 0 (always, in production) = off."""

    @model_validator(mode="after")
    def _check(self):
        if any(not math.isfinite(b) for b in self.reward_buckets) or self.reward_buckets != sorted(
            set(self.reward_buckets)
        ):
            raise ValueError("reward.reward_buckets must be finite, strictly increasing")
        worst_s = self.timeout_s * math.ceil(self.max_batch_size / self.pool_size) + self.max_batch_ms / 1000
        if self.max_poll_interval_ms / 1000 <= worst_s:
            raise ValueError(
                f"reward.max_poll_interval_ms={self.max_poll_interval_ms} must exceed the worst-case batch time "
                f"timeout_s * ceil(max_batch_size / pool_size) + max_batch_ms = {worst_s:.1f} s"
            )
        if self.chaos_delay_in_txn_ms >= self.transaction_timeout_ms:
            raise ValueError("reward.chaos_delay_in_txn_ms must be below reward.transaction_timeout_ms")
        return self
