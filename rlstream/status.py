"""``rlstream status``: where is the bottleneck? Built from Kafka alone (topic offsets, group
offsets, rl.control, rl.metrics, rl.dlq), so it works from any machine that reaches the cluster.

Per stage (prompts → rollout group, rollouts → reward group, scored → trainer group): produced
records, committed position, lag in records per partition, lag in policy versions (trainer version
minus ``version_min`` of the oldest unconsumed record), and throughput from two offset samples
``interval`` seconds apart. Plus the trainer's version, each rollout worker's loaded version,
DLQ counts by reason with the first error message of each, stale-dropped counts, the trainer
inside a long step (``busy in step 3 for 80 s (forward-backward, micro-batch 3/8)``) and the
newest metrics per worker.

It only reads; it never commits or joins a group.
"""

from __future__ import annotations

import time

from pipeline import codec
from pipeline.admin import Admin
from pipeline.errors import DecodeError
from pipeline.kafka import Consumer, TopicPartition, client_conf
from pipeline.notice_auth import verified
from pipeline.topology import STAGES, Topology
from rlstream.stall import DeadLetters, StallWatch


class StatusReader:
    def __init__(self, cfg):
        self.cfg = cfg
        self.admin = Admin(client_conf(cfg, "status"), cfg.kafka.request_timeout_s)
        self.consumer = Consumer(client_conf(cfg, "status", kind="consumer"))

    def close(self) -> None:
        self.consumer.close()
        self.admin.close()

    # -- raw reads ---------------------------------------------------------------------------
    def _read_all(self, topic: str) -> list:
        return self.consumer.read_to_end(topic, timeout=30, strict=False)

    def _record_at(self, topic: str, partition: int, offset: int, hi: int) -> dict | None:
        """Decode the first record at or after ``offset`` (skipping transaction markers)."""
        if offset >= hi:
            return None
        self.consumer.assign([TopicPartition(topic, partition, offset)])
        try:
            for _ in range(10):
                for m in self.consumer.consume(1, 0.5):
                    try:
                        return codec.decode(m.value())[1]
                    except DecodeError:
                        return None
            return None
        finally:
            self.consumer.unassign()

    # -- views -------------------------------------------------------------------------------
    def control(self) -> dict:
        updates = []
        for m in self._read_all(self.cfg.topics.name("control")):
            try:
                name, rec = codec.decode(m.value())
            except DecodeError:
                continue
            if name == "WeightUpdate":
                updates.append(rec)
        good = verified(self.cfg.store, updates)  # signed by the job's trainer (pipeline.notice_auth)
        latest = max(good, key=lambda r: r["version"], default=None)
        return {
            "trainer_version": latest["version"] if latest else 0,
            "weight_updates": len(good),
            "refused_updates": len(updates) - len(good),
            "latest_update": latest,
        }

    def metrics(self, window_s: float = 600) -> dict[str, dict]:
        """Newest MetricEvent per role/worker within the window."""
        newest: dict[str, dict] = {}
        cutoff = time.time() * 1000 - window_s * 1000
        for m in self._read_all(self.cfg.topics.name("metrics")):
            try:
                rec = codec.decode_as(m.value(), "MetricEvent")
            except DecodeError:
                continue
            key = f"{rec['role']}/{rec['worker_id']}"
            if rec["timestamp_ms"] >= cutoff and (
                key not in newest or rec["timestamp_ms"] >= newest[key]["timestamp_ms"]
            ):
                newest[key] = rec
        return newest

    def dlq(self) -> dict[str, dict]:
        """reason -> {count, first_error}: every dead letter on the topic, the earliest one's message."""
        dead = DeadLetters()
        for m in self._read_all(self.cfg.topics.name("dlq")):
            try:
                dead.add(codec.decode_as(m.value(), "DeadLetter"))
            except DecodeError:
                dead.add_undecodable()
        return {reason: {"count": r.count, "first_error": r.first} for reason, r in dead.by_reason().items()}

    def offsets(self) -> dict[str, dict]:
        out = {}
        for stage, topic, group in Topology(self.cfg).inputs():
            marks = self.admin.watermarks(topic)
            committed = self.admin.committed(group, topic, len(marks)) if group else {}
            out[stage] = {"topic": topic, "group": group, "marks": marks, "committed": committed}
        return out

    def _dlq_view(self) -> dict:
        """``dlq``: counts by reason (as before); ``dlq_first_error``: the first message of each."""
        by_reason = self.dlq()
        return {
            "dlq": {k: v["count"] for k, v in by_reason.items()},
            "dlq_first_error": {k: v["first_error"] for k, v in by_reason.items()},
        }

    def snapshot(self, interval: float = 2.0) -> dict:
        t0 = time.time()
        first = self.offsets()
        time.sleep(interval)
        second = self.offsets()
        dt = time.time() - t0
        ctl = self.control()
        version = ctl["trainer_version"]
        stages = {}
        for stage in first:
            a, b = first[stage], second[stage]
            parts = {}
            for p, (lo, hi) in b["marks"].items():
                c = b["committed"].get(p, -1)
                pos = c if c >= 0 else lo
                rec = self._record_at(b["topic"], p, pos, hi) if STAGES[stage].input != "prompts" and hi > pos else None
                vmin = (rec.get("trajectory", rec) or {}).get("version_min") if rec else None
                parts[p] = {
                    "end_offset": hi,
                    "committed": c,
                    "lag": hi - pos,
                    "lag_versions": (version - vmin) if vmin is not None else 0,
                }
            produced = sum(hi for _, hi in b["marks"].values()) - sum(hi for _, hi in a["marks"].values())
            consumed = sum(max(c, 0) for c in b["committed"].values()) - sum(max(c, 0) for c in a["committed"].values())
            stages[stage] = {
                "input_topic": b["topic"],
                "group": b["group"],
                "lag": sum(x["lag"] for x in parts.values()),
                "max_lag_versions": max((x["lag_versions"] for x in parts.values()), default=0),
                "input_records_per_s": round(produced / dt, 2),
                "consumed_records_per_s": round(consumed / dt, 2),
                "partitions": parts,
            }
        mets = self.metrics()
        rollout_versions = {k.split("/", 1)[1]: r["version"] for k, r in mets.items() if r["role"] == "rollout"}
        stale = sum(
            v
            for r in mets.values()
            if r["role"] == "trainer"
            for k, v in r["metrics"].items()
            if "stale" in k and not k.endswith("_rate")
        )
        evals = sorted((r for r in mets.values() if r["role"] == "eval"), key=lambda r: r["version"])
        watch = StallWatch(0.0, 0.0)  # the trainer inside a long step, from its newest in-step event
        for r in sorted((r for r in mets.values() if r["role"] == "trainer"), key=lambda r: r["timestamp_ms"]):
            watch.add_metric(r)
        return {
            "trainer_busy": watch.busy(time.time()),
            "eval": {
                "version": evals[-1]["version"],
                "reward_mean": evals[-1]["metrics"].get("eval_reward_mean"),
                "pass_at_1": evals[-1]["metrics"].get("eval_pass_at_1"),
            }
            if evals
            else None,
            "time": t0,
            "interval_s": round(dt, 2),
            "trainer_version": version,
            "weight_updates": ctl["weight_updates"],
            "rollout_loaded_versions": rollout_versions,
            "stages": stages,
            **self._dlq_view(),
            "stale_dropped": stale,
            "workers": {
                k: {
                    "role": r["role"],
                    "version": r["version"],
                    "age_s": round(time.time() - r["timestamp_ms"] / 1000, 1),
                    "metrics": {m: round(v, 4) for m, v in sorted(r["metrics"].items())},
                }
                for k, r in mets.items()
            },
        }


def render(snap: dict):
    """A rich renderable of a snapshot."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"rlstream status — trainer version {snap['trainer_version']}", expand=False)
    for col in ("stage", "input topic", "group", "lag (records)", "lag (versions)", "in/s", "consumed/s"):
        t.add_column(col)
    for stage, s in snap["stages"].items():
        t.add_row(
            stage,
            s["input_topic"],
            s["group"] or "-",
            str(s["lag"]),
            str(s["max_lag_versions"]),
            f"{s['input_records_per_s']:.1f}",
            f"{s['consumed_records_per_s']:.1f}",
        )
    w = Table(title="workers")
    for col in ("worker", "version", "age s", "key metrics"):
        w.add_column(col)
    for k, r in sorted(snap["workers"].items()):
        keys = [m for m in r["metrics"] if m.endswith("_rate")][:4]
        w.add_row(k, str(r["version"]), str(r["age_s"]), ", ".join(f"{m}={r['metrics'][m]:.2f}" for m in keys))
    extra = Table(show_header=False)
    first = snap.get("dlq_first_error", {})
    extra.add_row(
        "DLQ by reason",
        escape("\n".join(f"{k}: {v}" + (f" ({first[k]})" if first.get(k) else "") for k, v in snap["dlq"].items()))
        or "empty",
    )
    if snap.get("trainer_busy"):
        extra.add_row("trainer", escape(snap["trainer_busy"]))
    extra.add_row("stale dropped", str(int(snap["stale_dropped"])))
    if snap.get("eval"):
        e = snap["eval"]
        extra.add_row("eval (newest)", f"v{e['version']}: reward {e['reward_mean']:.3f}, pass@1 {e['pass_at_1']:.3f}")
    extra.add_row(
        "rollout versions", ", ".join(f"{k}: v{v}" for k, v in snap["rollout_loaded_versions"].items()) or "-"
    )
    return Group(t, w, extra)


def show(cfg, json_out: bool = False, watch: bool = False, interval: float = 2.0) -> None:
    """``rlstream status``: one snapshot (table or JSON), or a live view until Ctrl-C."""
    import json

    from rich.console import Console

    reader = StatusReader(cfg)
    try:
        if json_out:
            print(json.dumps(reader.snapshot(interval), indent=2, default=str))
            return
        out = Console()
        if not watch:
            out.print(render(reader.snapshot(interval)))
            return
        from rich.live import Live

        with Live(render(reader.snapshot(interval)), console=out, refresh_per_second=1) as live:
            while True:
                live.update(render(reader.snapshot(interval)))
    except KeyboardInterrupt:
        pass
    finally:
        reader.close()


def describe_topics(cfg, json_out: bool = False) -> None:
    """``rlstream topics describe``: partitions, replication, configs and messages per topic."""
    import json

    from rich.console import Console
    from rich.table import Table

    keys = ("retention.ms", "cleanup.policy", "max.message.bytes")
    names = [cfg.topics.name(r) for r in cfg.topics.specs()]
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    try:
        infos = admin.describe(names, with_offsets=True)
    finally:
        admin.close()
    if json_out:
        print(
            json.dumps(
                {
                    n: {
                        "partitions": i.partitions,
                        "replication_factor": i.replication_factor,
                        "messages": i.messages,
                        "configs": {k: i.configs.get(k) for k in keys},
                    }
                    for n, i in infos.items()
                },
                indent=2,
            )
        )
        return
    t = Table("topic", "partitions", "rf", "messages", "retention.ms", "cleanup", "max.message.bytes")
    for n, i in infos.items():
        t.add_row(
            n, str(i.partitions), str(i.replication_factor), str(i.messages), *(i.configs.get(k, "") for k in keys)
        )
    Console().print(t)
