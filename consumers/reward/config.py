"""Configuration of the reward workers: the consumer group and transactions, batching, the scoring
pool, which reward functions score which task, sandbox limits and metrics.

Only validation lives here; the worker (``consumers.reward.worker``) interprets the values.
"""

from __future__ import annotations

import math

from pydantic import Field, model_validator

from libs.rewards.config import RewardSpec, SandboxConfig, ScoringConfig  # noqa: F401  (re-exported)
from pipeline.topology import DEFAULT as DEFAULT_IDENTITY


class RewardConfig(ScoringConfig):
    """The reward workers' section: scoring (``ScoringConfig``) plus the consumer group, transactions, batching and metrics."""

    group_id: str = DEFAULT_IDENTITY.group("reward")
    """Consumer group of the reward workers (``rlstream-reward``; ``rlstream run`` names it after
    the job: ``pipeline.topology.RunIdentity``)."""
    worker_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")
    """This worker's id. None: ``<hostname>-<pid>``. Keep it stable across restarts so the
    transactional id (and with it zombie fencing) carries over."""
    group_instance_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")
    """Static membership (``group.instance.id``): a restart within the session timeout keeps the
    partitions without a rebalance. None: dynamic membership."""
    max_consumer_replacements: int = Field(3, ge=0, le=100)
    """A static member fenced by a consumer with its own ``group.instance.id`` (librdkafka can do
    this to itself after a broker restart) replaces its consumer in place, up to this many times
    in 10 minutes; past that (another live process uses the same id) it exits with the error."""
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
    close_whole_groups: bool = True
    """Close a batch as soon as nothing more is fetched and every group in it has ``rl.group_size``
    samples (a group's samples share a key, so they reach one partition and one worker), without
    waiting out ``batch_idle_ms``: a step's samples are scored and reach the trainer one quiet
    window sooner (docs/results/performance.md#where-a-k--0-step-goes). False, or ``batch_idle_ms = 0``: only the windows
    above close a batch."""
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
    heartbeat_interval_ms: int | None = Field(None, ge=100, le=3_600_000)
    """``heartbeat.interval.ms``; None: a quarter of ``session_timeout_ms``, at most 3000. With the
    classic group protocol a member learns of a rebalance only from a heartbeat answer, and a
    cooperative rebalance (a worker joins or leaves) takes two rounds, so the moved partitions are
    unowned for about twice this long. It was a quarter of the session timeout (11.25 s), which froze
    ``rlstream run`` for ~11 s when a second reward worker joined late (docs/how-to/multi-machine.md,
    "Rebalances"). 500 brings that to ~1 s but makes a known race of static members more likely
    (docs/results/performance.md, "Rebalance pauses"). Must be below ``session_timeout_ms``."""

    def heartbeat_ms(self) -> int:
        """The ``heartbeat.interval.ms`` the worker uses (``heartbeat_interval_ms``, or its default)."""
        return self.heartbeat_interval_ms or min(3000, max(100, self.session_timeout_ms // 4))

    max_poll_interval_ms: int = Field(600_000, ge=1000, le=86_400_000)
    """``max.poll.interval.ms``; must exceed the worst-case time to score one batch."""
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
        if self.heartbeat_interval_ms is not None and self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"reward.heartbeat_interval_ms={self.heartbeat_interval_ms} must be below "
                f"reward.session_timeout_ms={self.session_timeout_ms}"
            )
        if self.chaos_delay_in_txn_ms >= self.transaction_timeout_ms:
            raise ValueError("reward.chaos_delay_in_txn_ms must be below reward.transaction_timeout_ms")
        return self
