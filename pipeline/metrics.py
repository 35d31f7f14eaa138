"""Worker metrics: one small registry per worker that publishes MetricEvents to rl.metrics and,
optionally, serves Prometheus ``/metrics``.

Counters only grow (``inc``); gauges hold the last value (``set``); ``observe`` keeps a
window of values and reports count/mean/p50/p90/max. ``maybe_publish`` sends one MetricEvent
with every metric as ``name`` (plus ``name_rate`` per second for counters) every
``interval_s``. It is not a metrics system: Prometheus or the rl.metrics topic is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

from pipeline.control import now_ms
from pipeline.log import kv

log = logging.getLogger(__name__)

ZERO_COUNTERS = ("dead_letters",)
"""Counters every worker reports from its first event on, even while they are 0."""


class WorkerMetrics:
    def __init__(
        self,
        role: str,
        worker_id: str,
        producer=None,
        topic: str | None = None,
        interval_s: float = 2.0,
        prometheus_port: int = 0,
        labels: dict | None = None,
    ):
        self.role, self.worker_id = role, worker_id
        self.producer, self.topic, self.interval_s = producer, topic, interval_s
        self.labels = dict(labels or {})
        self.version = -1
        self.counters: dict[str, float] = defaultdict(float)
        for name in ZERO_COUNTERS:  # reported from the start: dashboards and alerts see a 0, not no data
            self.counters[name] = 0.0
        self.gauges: dict[str, float] = {}
        self.windows: dict[str, list[float]] = defaultdict(list)
        self._last_counters: dict[str, float] = {}
        self._last_t = time.monotonic()
        self._lock = threading.Lock()
        self._last_metrics: dict[str, float] = {}
        self._prom = None
        if prometheus_port:
            self._start_prometheus(prometheus_port)

    # -- recording -----------------------------------------------------------------------------
    def inc(self, name: str, by: float = 1.0) -> None:
        with self._lock:
            self.counters[name] += by

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = float(value)

    def set_fault(self, text: str | None) -> dict | None:
        """Say (``text``: one line, e.g. ``disk full at /x (need 540 MB free, 12 MB left); paused``) or
        clear (None) the fault this worker waits on now. The event carries it as ``labels["fault"]``;
        ``rlstream run`` prints it when it appears and again when it ends, and Prometheus gets
        ``rlstream_fault`` (1 while a fault lasts). Published at once when it changes: the event, or
        None when nothing changed."""
        with self._lock:
            if self.labels.get("fault") == text or (text is None and "fault" not in self.labels):
                return None
            if text is None:
                self.labels.pop("fault", None)
            else:
                self.labels["fault"] = text
            self.gauges["fault"] = 0.0 if text is None else 1.0
        log.warning("fault %s", kv(role=self.role, worker=self.worker_id, fault=text or "ended"))
        return self.publish_extra({"fault": self.gauges["fault"]}, {})

    @property
    def fault(self) -> str | None:
        """The fault this worker says it waits on now (``set_fault``), or None."""
        return self.labels.get("fault")

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            w = self.windows[name]
            w.append(float(value))
            if len(w) > 10_000:
                del w[: len(w) - 10_000]

    # -- reporting -----------------------------------------------------------------------------
    def snapshot(self, reset_windows: bool = True) -> dict[str, float]:
        with self._lock:
            now = time.monotonic()
            dt = max(now - self._last_t, 1e-9)
            out = dict(self.gauges)
            for k, v in self.counters.items():
                out[k] = v
                out[f"{k}_rate"] = (v - self._last_counters.get(k, 0.0)) / dt
            for k, w in self.windows.items():
                if w:
                    s = sorted(w)
                    out[f"{k}_count"] = len(s)
                    out[f"{k}_mean"] = sum(s) / len(s)
                    out[f"{k}_p50"] = s[len(s) // 2]
                    out[f"{k}_p90"] = s[min(len(s) - 1, int(len(s) * 0.9))]
                    out[f"{k}_max"] = s[-1]
            self._last_counters = dict(self.counters)
            self._last_t = now
            if reset_windows:
                self.windows.clear()
            return out

    def event(self, metrics: dict[str, float]) -> dict:
        return {
            "role": self.role,
            "worker_id": self.worker_id,
            "timestamp_ms": now_ms(),
            "version": int(self.version),
            "metrics": metrics,
            "labels": dict(self.labels),
        }

    def publish(self) -> dict:
        ev = self.event(self.snapshot())
        self._last_metrics = dict(ev["metrics"])
        if self.producer is not None and self.topic:
            self.producer.produce_record(self.topic, "MetricEvent", ev, key=f"{self.role}/{self.worker_id}".encode())
        self._update_prometheus(ev["metrics"])
        return ev

    def publish_extra(self, metrics: dict[str, float], labels: dict[str, str], producer=None) -> dict:
        """One MetricEvent of the last published metrics plus ``metrics`` and ``labels`` (a trainer's
        in-step progress: ``consumers.trainer.heartbeat``), through ``producer`` (default: the
        worker's own); windows and rates are left as they are."""
        ev = {**self.event({**self._last_metrics, **metrics}), "labels": {**self.labels, **labels}}
        producer = producer or self.producer
        if producer is not None and self.topic:
            producer.produce_record(self.topic, "MetricEvent", ev, key=f"{self.role}/{self.worker_id}".encode())
        return ev

    def maybe_publish(self) -> dict | None:
        if time.monotonic() - self._last_t >= self.interval_s:
            return self.publish()
        return None

    # -- prometheus ----------------------------------------------------------------------------
    def _start_prometheus(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self._registry = CollectorRegistry()
        self._prom = {}
        self._Gauge = Gauge
        self.prometheus_server, _ = start_http_server(port, registry=self._registry)
        self.prometheus_port = self.prometheus_server.server_port
        log.info("serving prometheus metrics %s", kv(role=self.role, port=self.prometheus_port))

    def _update_prometheus(self, metrics: dict[str, float]) -> None:
        if self._prom is None:
            return
        # policy_version only for a worker that holds weights (trainer, rollout, eval): a reward
        # worker's version stays -1, which is no version, so it has no such series at all
        own = {"policy_version": float(self.version)} if self.version >= 0 else {}
        for k, v in {**metrics, **own}.items():
            name = "rlstream_" + "".join(c if c.isalnum() else "_" for c in k)
            g = self._prom.get(name)
            if g is None:
                g = self._prom[name] = self._Gauge(name, k, ["role", "worker"], registry=self._registry)
            g.labels(self.role, self.worker_id).set(v)

    def close(self) -> None:
        if self._prom is not None:
            self.prometheus_server.shutdown()
