"""Benchmark 4, scaling: reward-stage throughput (trajectories/s, exactly-once loop included) with 1,
2 and 4 ``rlstream reward`` workers in one consumer group, trivial ``exact_match`` reward, over a
rollouts topic with 8 partitions.

For each worker count: fresh topics; start the workers and wait until the group is stable with every
member holding partitions (so no rebalance falls inside the measurement); produce N trajectories;
wait until the group's lag is 0. Throughput is N over the span of the broker timestamps of the
scored records (first to last), per-worker shares come from ``scorer_id``. On a 2-core machine the
workers, the broker and the producer share two cores, so this shows the coordination cost of
adding members more than the gain of more hardware. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rlstream.bench.harness import (
    BenchContext,
    group_stable,
    log_line,
    make_config,
    md_table,
    read_topic,
    rnd,
    run_pipeline,
    write_json,
)
from rlstream.bench.transport import produce_rollouts, trajectories

SIZES = {
    "tiny": {"workers": [1, 2], "trajectories": 512, "response_tokens": 128},
    "full": {"workers": [1, 2, 4], "trajectories": 8000, "response_tokens": 256},
}


def run_case(ctx: BenchContext, workers: int, sz: dict) -> dict:
    name = f"scaling-w{workers}"
    cfg, path = make_config(
        ctx,
        name,
        [
            "topics.rollouts.partitions=8",
            "topics.scored.partitions=8",
            'reward.executor="thread"',
            "reward.pool_size=1",
            "reward.max_batch_size=128",
            "reward.max_batch_ms=50",
            "reward.timeout_s=2",
            "reward.idle_poll_s=0.1",
        ],
    )
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    admin = Admin(client_conf(cfg, "bench"))
    state = {"produced": False, "joined_s": None}
    t0 = time.monotonic()

    def driver():  # once the group is stable, produce the work
        while time.monotonic() - t0 < 180 and not group_stable(cfg, cfg.reward.group_id, workers):
            time.sleep(0.5)
        state["joined_s"] = round(time.monotonic() - t0, 1)
        produce_rollouts(cfg, trajectories(sz["trajectories"], 32, sz["response_tokens"]))
        state["produced"] = True

    def done() -> bool:
        if not state["produced"]:
            return False
        try:
            return sum(admin.lag(cfg.reward.group_id, cfg.topics.name("rollouts")).values()) == 0
        except Exception:
            return False

    th = threading.Thread(target=driver, daemon=True)
    th.start()
    res = run_pipeline(ctx, cfg, path, 0, workers, feed=False, trainer=False, timeout_s=600, done=done)
    th.join(5)
    scored = read_topic(cfg, "scored", "ScoredTrajectory")
    ts = sorted(t for t, *_ in scored)
    span = (ts[-1] - ts[0]) / 1e3 if len(ts) > 1 else float("nan")
    shares: dict[str, int] = {}
    for _, _, _, rec in scored:
        shares[rec["scorer_id"]] = shares.get(rec["scorer_id"], 0) + 1
    row = {
        "workers": workers,
        "status": res.status,
        "trajectories": len(ts),
        "seconds": rnd(span, 2),
        "trajectories_per_s": rnd(len(ts) / span if span == span and span > 0 else None, 0),
        "per_worker": dict(sorted(shares.items())),
        "group_stable_after_s": state["joined_s"],
        "loadavg": res.loadavg,
    }
    log_line(ctx, name, trajectories_per_s=row["trajectories_per_s"], n=len(ts), status=res.status)
    return row


def run(ctx: BenchContext) -> dict:
    sz = SIZES[ctx.size]
    rows = [run_case(ctx, w, sz) for w in sz["workers"]]
    base = rows[0].get("trajectories_per_s")
    for r in rows:
        r["speedup_over_1"] = rnd((r.get("trajectories_per_s") or 0) / base) if base else None
    result = {"benchmark": "scaling", "size": ctx.size, "response_tokens": sz["response_tokens"], "runs": rows}
    write_json(ctx.out / "scaling.json", result)
    result["plots"] = [str(p) for p in plot(ctx.out, rows)]
    write_json(ctx.out / "scaling.json", result)
    return result


def table(result: dict) -> str:
    rows = [
        [r["workers"], r["trajectories"], r.get("trajectories_per_s"), r.get("speedup_over_1"),
         " / ".join(str(v) for v in r["per_worker"].values())]
        for r in result["runs"]
    ]  # fmt: skip
    return md_table(["reward workers", "trajectories", "traj/s", "speedup vs 1", "records per worker"], rows)


def plot(out: Path, rows: list[dict]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    ws = [r["workers"] for r in rows]
    ax.plot(ws, [r.get("trajectories_per_s") or 0 for r in rows], "o-", label="measured")
    base = rows[0].get("trajectories_per_s") or 0
    ax.plot(ws, [base * w for w in ws], "--", color="#999999", label="linear")
    ax.set_xticks(ws)
    ax.set_xlabel("reward workers (one consumer group)")
    ax.set_ylabel("trajectories/s")
    ax.set_title("reward-stage scaling (trivial reward)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "scaling.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]
