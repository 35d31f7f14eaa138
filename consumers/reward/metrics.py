"""The reward worker's metrics on top of the shared ``pipeline.metrics.WorkerMetrics``.

Recorded only for committed transactions: ``consumed`` (with ``consumed_rate``, trajectories/s),
``scored``, ``dead_letters`` and ``dead_letters.<error_type>``, ``transactions``, ``txn_aborts``; per task
``task.<task>.count``, ``task.<task>.reward_mean`` (since start), ``task.<task>.reward_le_<b>``
(cumulative histogram buckets) and the window stats of ``task.<task>.reward`` (count, mean, p50,
p90, max); ``verifier_latency_ms`` and ``txn_ms`` windows; the ``commit_gap_s`` window (seconds between
one commit and the next: a long one is a pause of this worker, e.g. during a rebalance; the run report's
``longest_pause_s`` takes its maximum). Publishing (a MetricEvent keyed
``reward/<worker_id>`` on the metrics topic) and Prometheus are the shared class's job.
"""

from __future__ import annotations

import time

from pipeline.metrics import WorkerMetrics


class RewardMetrics:
    def __init__(self, worker_id: str, reward_cfg, producer=None, topic: str | None = None):
        self.buckets = list(reward_cfg.reward_buckets)
        self.m = WorkerMetrics(
            "reward",
            worker_id,
            producer=producer,
            topic=topic,
            interval_s=reward_cfg.metrics_interval_s,
            prometheus_port=reward_cfg.prometheus_port,
        )
        self._sums: dict[str, float] = {}
        self.first_message_at: float | None = None
        self.last_commit_at: float | None = None

    @property
    def counters(self) -> dict[str, float]:
        return self.m.counters

    def consumed(self) -> None:
        if self.first_message_at is None:
            self.first_message_at = time.monotonic()

    def committed(
        self,
        scored: list[tuple[str, float, float]],
        dead: list[tuple[str, float]],
        txn_ms: float,
    ) -> None:
        """One committed transaction: ``scored`` = (task, reward, latency_ms), ``dead`` = (error_type, latency_ms)."""
        m = self.m
        m.inc("consumed", len(scored) + len(dead))
        m.inc("scored", len(scored))
        m.inc("transactions")
        m.observe("txn_ms", txn_ms)
        m.observe("batch_size", len(scored) + len(dead))
        for task, reward, ms in scored:
            m.inc(f"task.{task}.count")
            self._sums[task] = self._sums.get(task, 0.0) + reward
            m.set(f"task.{task}.reward_mean", self._sums[task] / m.counters[f"task.{task}.count"])
            for b in self.buckets:  # every bucket exists from the first reward on, empty ones as 0
                m.inc(f"task.{task}.reward_le_{b:g}", 1.0 if reward <= b else 0.0)
            m.observe(f"task.{task}.reward", reward)
            m.observe("verifier_latency_ms", ms)
        for error_type, ms in dead:
            m.inc("dead_letters")
            m.inc(f"dead_letters.{error_type}")
            if ms:
                m.observe("verifier_latency_ms", ms)
        now = time.monotonic()
        if self.last_commit_at is not None:
            m.observe("commit_gap_s", now - self.last_commit_at)
        self.last_commit_at = now

    def aborted(self) -> None:
        self.m.inc("txn_aborts")

    def maybe_publish(self) -> dict | None:
        return self.m.maybe_publish()

    def publish(self) -> dict:
        return self.m.publish()

    def close(self) -> None:
        self.m.close()
