"""Benchmark 4, scale on one broker: how the stages grow with worker processes on this machine, what
a record costs in CPU per stage and in the broker, how long a rebalance takes when 8 workers join at
once, and a projection to 64+ workers per stage from those costs.

* **Reward stage** (the exactly-once loop, trivial ``exact_match``): 1, 2, 4, 8 ``rlstream reward``
  workers over a rollouts topic with 16 partitions; N trajectories produced once the group is stable;
  throughput over the broker timestamps of the scored records.
* **Rollout stage** (``sim`` engine with a near-zero token latency, so the worker's own loop is
  what is measured): 1, 2, 4, 8 ``rlstream rollout`` workers and the feed; trajectories/s.
* **Rebalance**: a rollout group of 8 sim workers (32 partitions), stable; then 8 more start at
  once; seconds until the group is stable with 16 members each holding partitions.
* **CPU per record**: user + system seconds of the stage's worker processes and of the broker process
  over the run, divided by the records it moved.
* **Projection**: with one core per worker, a stage runs at workers / (worker CPU per record); one
  broker core moves 1 / (broker CPU per record, summed over the stages) records; the table shows
  where the broker, not the workers, becomes the limit. It is arithmetic on measured costs, not a
  measurement at that scale (the 2 cores here saturate long before).

It prints figures; it asserts nothing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rlstream.dev.bench.harness import (
    BenchContext,
    cpu_seconds,
    cpu_since,
    group_stable,
    log_line,
    make_config,
    md_table,
    pyplot,
    read_topic,
    rnd,
    run_pipeline,
    write_json,
)
from rlstream.dev.bench.transport import produce_rollouts, trajectories

SIZES = {
    "tiny": {"workers": [1, 2], "trajectories": 512, "response_tokens": 128, "groups": 40, "join": 2},
    "full": {"workers": [1, 2, 4, 8], "trajectories": 8000, "response_tokens": 256, "groups": 400, "join": 8},
}
SIM = {"rollout.engine": {"type": "sim", "token_latency_s": 0.0005, "median_tokens": 16, "sigma": 0.3,
                          "verify_weights": False}}  # fmt: skip
PROJECT_TO = (8, 16, 64, 128, 256)


IDLE: dict[str, float] = {}


def broker_idle_rate(ctx: BenchContext, seconds: float = 10.0) -> float:
    """CPU seconds per second the broker spends with nothing to do (subtracted from its per-record cost)."""
    before = cpu_seconds(ctx.broker_pid)
    time.sleep(seconds)
    return cpu_since(ctx.broker_pid, before) / seconds


def _row(stage: str, workers: int, res, records: int, span: float) -> dict:
    """A result row: throughput over the records' broker timestamps, CPU per record over the work
    (the broker's minus what it burns idle over the same window)."""
    n = records or 1
    broker = res.cpu_s.get("broker")
    if broker is not None:
        broker = max(0.0, broker - IDLE.get("broker", 0.0) * res.work_s)
    worker_cpu = sum(c for k, c in res.cpu_s.items() if k.startswith(f"{stage}-"))
    row = {
        "stage": stage, "workers": workers, "status": res.status, "records": records,
        "records_per_s": rnd(records / span if span == span and span > 0 else None, 0),
        "worker_cpu_ms_per_record": rnd(1e3 * worker_cpu / n, 3) if res.cpu_s else None,
        "broker_cpu_ms_per_record": rnd(1e3 * broker / n, 3) if broker is not None else None,
        "loadavg": res.loadavg,
    }  # fmt: skip
    return row


def reward_case(ctx: BenchContext, workers: int, sz: dict) -> dict:
    name = f"scaling-reward-w{workers}"
    cfg, path = make_config(ctx, name, {
        "topics.rollouts.partitions": 16, "topics.scored.partitions": 16, "reward.executor": "thread",
        "reward.pool_size": 1, "reward.max_batch_size": 128, "reward.max_batch_ms": 50, "reward.timeout_s": 2,
        "reward.idle_poll_s": 0.1,
    })  # fmt: skip
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    admin = Admin(client_conf(cfg, "bench"))
    state = {"produced": False}
    started = threading.Event()

    def driver():  # once the group is stable, produce the work
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300 and not group_stable(cfg, cfg.reward.group_id, workers):
            time.sleep(0.5)
        started.set()
        time.sleep(0.5)  # the harness takes its CPU snapshot
        produce_rollouts(cfg, trajectories(sz["trajectories"], 32, sz["response_tokens"]))
        state["produced"] = True

    def done() -> bool:
        try:
            return state["produced"] and sum(admin.lag(cfg.reward.group_id, cfg.topics.name("rollouts")).values()) == 0
        except Exception:
            return False

    th = threading.Thread(target=driver, daemon=True)
    th.start()
    res = run_pipeline(ctx, cfg, path, 0, workers, feed=False, trainer=False, timeout_s=900, done=done,
                       work_started=started)  # fmt: skip
    th.join(5)
    admin.close()
    scored = read_topic(cfg, "scored", "ScoredTrajectory")
    ts = sorted(t for t, *_ in scored)
    span = (ts[-1] - ts[0]) / 1e3 if len(ts) > 1 else float("nan")
    row = _row("reward", workers, res, len(ts), span)
    log_line(ctx, name, **{k: row[k] for k in ("records_per_s", "worker_cpu_ms_per_record", "status")})
    return row


def rollout_case(ctx: BenchContext, workers: int, sz: dict) -> dict:
    from rlstream.dev.bench.async_sync import write_prompts

    name = f"scaling-rollout-w{workers}"
    source = write_prompts(ctx.out / f"{name}-prompts.jsonl", 64)
    groups, n = sz["groups"], 4
    cfg, path = make_config(ctx, name, {
        "topics.prompts.partitions": 16, "topics.rollouts.partitions": 16, "rl.group_size": n,
        "rl.max_staleness": 1000, "feed.source": str(source), "feed.epochs": 100000, "feed.limit": groups,
        "rollout.max_inflight": 32, "rollout.max_new_tokens": 64, "rollout.poll_timeout_s": 0.02, **SIM,
    })  # fmt: skip
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    admin = Admin(client_conf(cfg, "bench"))

    def done() -> bool:
        try:
            marks = admin.watermarks(cfg.topics.name("rollouts"))
            return sum(hi - lo for lo, hi in marks.values()) >= groups * n
        except Exception:
            return False

    res = run_pipeline(ctx, cfg, path, workers, 0, feed=True, trainer=False, timeout_s=900, done=done)
    admin.close()
    recs = read_topic(cfg, "rollouts", "Trajectory")
    ts = sorted(t for t, *_ in recs)
    span = (ts[-1] - ts[0]) / 1e3 if len(ts) > 1 else float("nan")
    row = _row("rollout", workers, res, len(ts), span)
    log_line(ctx, name, **{k: row[k] for k in ("records_per_s", "worker_cpu_ms_per_record", "status")})
    return row


def join_case(ctx: BenchContext, join: int) -> dict:
    """A stable rollout group of ``join`` members; ``join`` more start at once; time to stable again."""
    from rlstream.dev.bench.harness import child_env
    from rlstream.launcher import role_config
    from rlstream.supervisor import Supervisor

    name = f"scaling-join-{join}"
    cfg, _ = make_config(ctx, name, {"topics.prompts.partitions": 4 * join, **SIM})
    from pipeline.admin import ensure_topics

    ensure_topics(cfg)
    out: dict = {"members_before": join, "joining": join}

    def start(i: int) -> None:
        own = role_config(cfg, Path(cfg.run_dir), f"rollout-{i}", {"rollout.worker_id": f"rollout-{i}"})
        sup.start(f"rollout-{i}", ["rollout", "--config", str(own)])

    with Supervisor(Path(cfg.run_dir) / "logs", child_env()) as sup:
        for i in range(join):
            start(i)
        t0 = time.monotonic()
        while not group_stable(cfg, cfg.rollout.group_id, join) and time.monotonic() - t0 < 600:
            sup.check()
            time.sleep(0.2)
        out["first_group_stable_s"] = rnd(time.monotonic() - t0, 1)
        t1 = time.monotonic()
        for i in range(join, 2 * join):
            start(i)
        while not group_stable(cfg, cfg.rollout.group_id, 2 * join) and time.monotonic() - t1 < 600:
            sup.check()
            time.sleep(0.2)
        out["rebalance_s"] = rnd(time.monotonic() - t1, 1)
        out["stable"] = group_stable(cfg, cfg.rollout.group_id, 2 * join)
    log_line(ctx, name, **out)
    return out


def project(rows: list[dict]) -> dict:
    """Throughput at W workers per stage from the single-worker CPU cost (a core per worker), and
    the samples/s one broker core carries through both stages."""
    one = {r["stage"]: r for r in rows if r["workers"] == 1}
    broker_ms = sum(r["broker_cpu_ms_per_record"] or 0 for r in one.values())
    stages = {}
    for stage, r in one.items():
        per_worker = 1e3 / r["worker_cpu_ms_per_record"] if r.get("worker_cpu_ms_per_record") else None
        stages[stage] = {w: rnd(w * per_worker, 0) if per_worker else None for w in PROJECT_TO}
    return {"worker_bound": stages, "broker_ms_per_sample": rnd(broker_ms, 3),
            "broker_samples_per_s_per_core": rnd(1e3 / broker_ms, 0) if broker_ms else None}  # fmt: skip


def run(ctx: BenchContext) -> dict:
    sz = SIZES[ctx.size]
    IDLE["broker"] = broker_idle_rate(ctx)
    rows = [reward_case(ctx, w, sz) for w in sz["workers"]] + [rollout_case(ctx, w, sz) for w in sz["workers"]]
    for stage in ("reward", "rollout"):
        mine = [r for r in rows if r["stage"] == stage]
        base = mine[0].get("records_per_s")
        for r in mine:
            r["speedup_over_1"] = rnd((r.get("records_per_s") or 0) / base) if base else None
    result = {"benchmark": "scaling", "size": ctx.size, "runs": rows, "join": join_case(ctx, sz["join"])}
    result["projection"] = project(rows)
    result["broker_idle_cpu_per_s"] = rnd(IDLE["broker"], 4)
    result["plots"] = [str(p) for p in plot(ctx.out, rows)]
    write_json(ctx.out / "scaling.json", result)
    return result


def table(result: dict) -> str:
    rows = [[r["stage"], r["workers"], r["records"], r.get("records_per_s"), r.get("speedup_over_1"),
             r.get("worker_cpu_ms_per_record"), r.get("broker_cpu_ms_per_record")] for r in result["runs"]]  # fmt: skip
    t = md_table(["stage", "workers", "records", "records/s", "speedup vs 1", "worker CPU ms/record",
                  "broker CPU ms/record"], rows)  # fmt: skip
    j = result["join"]
    t += (f"\n\nRebalance: {j['joining']} rollout workers joining a stable group of {j['members_before']} at once: "
          f"stable again after **{j['rebalance_s']} s** (stable: {j['stable']}).\n\n")  # fmt: skip
    p = result["projection"]
    bound = {s: {int(w): v for w, v in p["worker_bound"].get(s, {}).items()} for s in ("rollout", "reward")}
    proj = [[w, bound["rollout"].get(w), bound["reward"].get(w)] for w in PROJECT_TO]  # JSON keys are strings
    t += md_table(["workers per stage (1 core each)", "rollout-bound samples/s", "reward-bound samples/s"], proj)
    return t + (
        f"\n\nBroker: {p['broker_ms_per_sample']} ms of broker CPU per sample through both stages, i.e. "
        f"**{p['broker_samples_per_s_per_core']} samples/s per broker core**: W workers per stage need about "
        "(their worker-bound samples/s) / that figure broker cores."
    )


def plot(out: Path, rows: list[dict]) -> list[Path]:
    if (plt := pyplot()) is None:
        return []
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for stage in ("reward", "rollout"):
        mine = [r for r in rows if r["stage"] == stage]
        ax.plot([r["workers"] for r in mine], [r.get("records_per_s") or 0 for r in mine], "o-", label=stage)
    ax.set_xlabel("worker processes (one consumer group, 2 cores shared)")
    ax.set_ylabel("records/s")
    ax.set_title("stage throughput vs workers on one broker", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "scaling.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]
