"""Benchmark 3, weight-notice latency: from a WeightUpdate being published on rl.control (the
record's broker timestamp) to every rollout worker reporting that version (or a newer one) loaded
(the MetricEvent a worker publishes right after each load, with ``loaded_version``).

* **Notice latency** with 2 and 4 rollout workers (``sim`` engine, so the workers are busy
  generating but load instantly; ``sim`` trainer publishing a version every ~0.3 s; interrupt
  reload). p50 and p99 over versions of "publish -> all workers loaded", and of each worker's own
  "publish -> loaded".
* **Load time by checkpoint size**: the real ``hf`` engine on tiny models of growing hidden size
  (the ``sim`` trainer publishes the model's own weights each step): checkpoint bytes, the
  trainer's write time, the worker's fetch + sha256 verify, the in-place swap, and notice -> loaded.
* **Model scale** (``rlstream.dev.bench.weights_scale``): synthetic 1 GB and 4 GB Llama-shaped state
  dicts (``tiny``: 10 MB) written sharded and read by 1 and 2 rollout-worker processes, and a
  LoRA-sized adapter: notice -> every worker loaded, effective GB/s, and the generation pause.

It prints figures; it asserts nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlstream.dev.bench import weights_scale
from rlstream.dev.bench.async_sync import write_prompts
from rlstream.dev.bench.harness import (
    BenchContext,
    log_line,
    make_config,
    md_table,
    metric_events,
    percentile,
    pyplot,
    read_topic,
    rnd,
    run_pipeline,
    write_json,
)

SIZES = {
    "tiny": {"workers": [1], "steps": 4, "hidden": [64], "size_steps": 2, "size_workers": 1},
    "full": {"workers": [2, 4], "steps": 40, "hidden": [128, 512, 1024, 2048], "size_steps": 4, "size_workers": 2},
}


def model_sets(hidden: int) -> dict[str, Any]:
    return {
        "model.hidden_size": hidden,
        "model.intermediate_size": 2 * hidden,
        "model.num_layers": 2,
        "model.num_heads": max(4, hidden // 128),
        "model.max_position_embeddings": 128,
    }


def base_sets(source: Path, groups: int, n: int, steps: int, k: int = 1) -> dict[str, Any]:
    return {
        "rl.group_size": n,
        "rl.groups_per_step": groups,
        "rl.max_staleness": k,
        "topics.prompts.partitions": 4,
        "topics.rollouts.partitions": 4,
        "topics.scored.partitions": 2,
        "feed.source": str(source),
        "feed.epochs": 100000,
        "feed.limit": (steps + 4) * groups,
        "rollout.reload_policy": "interrupt",
        "rollout.metrics_interval_s": 1,
        "rollout.poll_timeout_s": 0.02,
        "reward.executor": "thread",
        "reward.pool_size": 1,
        "reward.max_batch_ms": 20,
        "reward.timeout_s": 2,
        "trainer.max_steps": steps,
        "trainer.metrics_interval_s": 1,
        "trainer.poll_timeout_s": 0.05,
        "trainer.keep_weight_versions": 4,
        "trainer.keep_checkpoints": 1,
        "trainer.group_timeout_s": 600,
    }


def latencies(cfg, workers: list[str]) -> dict:
    """Per published version: publish time, and when each worker first reported it (or newer) loaded."""
    published = {rec["version"]: ts / 1e3 for ts, _, _, rec in read_topic(cfg, "control", "WeightUpdate")}
    loads: dict[str, list[tuple[float, int]]] = {w: [] for w in workers}
    load_events = []
    trainer_write = []
    for ev in metric_events(cfg):
        m = ev["metrics"]
        if ev["role"] == "rollout" and ev["worker_id"] in loads and "loaded_version" in m:
            loads[ev["worker_id"]].append((ev["timestamp_ms"] / 1e3, int(m["loaded_version"])))
            if "weight_swap_ms_count" in m:  # the event published right after a load
                load_events.append(m)
        if ev["role"] == "trainer" and "weights_write_ms" in m:
            trainer_write.append(m["weights_write_ms"])
    all_ms, each_ms = [], []
    for v, t_pub in sorted(published.items()):
        if v == 0:
            continue
        firsts = []
        for w in workers:
            t = min((t for t, lv in loads[w] if lv >= v), default=None)
            if t is not None:
                firsts.append(t)
                each_ms.append((t - t_pub) * 1e3)
        if len(firsts) == len(workers):
            all_ms.append((max(firsts) - t_pub) * 1e3)
    fetch = [m["weight_fetch_ms_mean"] for m in load_events if "weight_fetch_ms_mean" in m]
    return {
        "versions_published": len([v for v in published if v > 0]),
        "versions_measured": len(all_ms),
        "all_loaded_ms_p50": rnd(percentile(all_ms, 50), 1),
        "all_loaded_ms_p99": rnd(percentile(all_ms, 99), 1),
        "per_worker_ms_p50": rnd(percentile(each_ms, 50), 1),
        "per_worker_ms_p99": rnd(percentile(each_ms, 99), 1),
        "notice_to_loaded_ms_p50": rnd(percentile([m["weight_load_ms"] for m in load_events], 50), 1),
        "fetch_verify_ms_p50": rnd(percentile(fetch, 50), 1),
        "swap_ms_p50": rnd(percentile([m["weight_swap_ms_mean"] for m in load_events], 50), 1),
        "trainer_write_ms_p50": rnd(percentile(trainer_write, 50), 1),
        "loads": len(load_events),
    }


def notice_case(ctx: BenchContext, workers: int, steps: int) -> dict:
    name = f"weights-notice-w{workers}"
    run_dir = ctx.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    source = write_prompts(run_dir / "prompts.jsonl", 64)
    groups, n = 4, 4
    sets = {
        **base_sets(source, groups, n, steps),
        **model_sets(64),
        "rollout.max_inflight": 16,
        "rollout.max_new_tokens": 64,
        "rollout.engine": {
            "type": "sim",
            "token_latency_s": 0.005,
            "median_tokens": 16,
            "sigma": 0.5,
            "clip_tokens": 64,
        },
        "trainer.engine": {"type": "sim", "token_cost_s": 0.0007},
        "trainer.micro_batch_size": 16,
    }
    cfg, path = make_config(ctx, name, sets)
    res = run_pipeline(ctx, cfg, path, workers, 1, timeout_s=600)
    row = {"workers": workers, "status": res.status, "loadavg": res.loadavg}
    row.update(latencies(cfg, [f"rollout-{i}" for i in range(workers)]))
    log_line(ctx, name, p50=row["all_loaded_ms_p50"], p99=row["all_loaded_ms_p99"], versions=row["versions_measured"])
    return row


def size_case(ctx: BenchContext, hidden: int, steps: int) -> dict:
    name = f"weights-size-h{hidden}"
    run_dir = ctx.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    source = write_prompts(run_dir / "prompts.jsonl", 16)
    sets = {
        **base_sets(source, 1, 2, steps),
        **model_sets(hidden),
        "rollout.max_inflight": 4,
        "rollout.max_new_tokens": 4,
        "rollout.engine": {"type": "hf", "device": "cpu", "threads": 1},
        "trainer.engine": {"type": "sim", "token_cost_s": 0.0},
        "trainer.micro_batch_size": 4,
    }
    cfg, path = make_config(ctx, name, sets)
    workers = SIZES[ctx.size]["size_workers"]
    res = run_pipeline(ctx, cfg, path, workers, 1, timeout_s=600)
    row = {"hidden_size": hidden, "status": res.status, "loadavg": res.loadavg}
    updates = [rec for _, _, _, rec in read_topic(cfg, "control", "WeightUpdate")]
    row["checkpoint_MB"] = rnd(max((u["bytes"] for u in updates), default=0) / 1e6, 2)
    row.update(latencies(cfg, [f"rollout-{i}" for i in range(workers)]))
    log_line(ctx, name, MB=row["checkpoint_MB"], fetch_ms=row["fetch_verify_ms_p50"], swap_ms=row["swap_ms_p50"])
    return row


def run(ctx: BenchContext) -> dict:
    sz = SIZES[ctx.size]
    notice = [notice_case(ctx, w, sz["steps"]) for w in sz["workers"]]
    sizes = [size_case(ctx, h, sz["size_steps"]) for h in sz["hidden"]]
    scale = weights_scale.run(ctx)
    result = {"benchmark": "weights", "size": ctx.size, "notice": notice, "sizes": sizes, "scale": scale}
    write_json(ctx.out / "weights.json", result)
    result["plots"] = [str(p) for p in plot(ctx.out, result)]
    write_json(ctx.out / "weights.json", result)
    return result


def table(result: dict) -> str:
    a = md_table(
        ["rollout workers", "versions", "publish → all loaded p50 ms", "p99 ms", "per worker p50 ms", "p99 ms",
         "fetch+verify p50 ms"],
        [[r["workers"], r["versions_measured"], r["all_loaded_ms_p50"], r["all_loaded_ms_p99"], r["per_worker_ms_p50"],
          r["per_worker_ms_p99"], r["fetch_verify_ms_p50"]] for r in result["notice"]],
    )  # fmt: skip
    b = md_table(
        ["hidden size", "checkpoint MB", "trainer write p50 ms", "fetch+verify p50 ms", "swap p50 ms",
         "notice → loaded p50 ms", "publish → all loaded p50 ms"],
        [[r["hidden_size"], r["checkpoint_MB"], r["trainer_write_ms_p50"], r["fetch_verify_ms_p50"], r["swap_ms_p50"],
          r["notice_to_loaded_ms_p50"], r["all_loaded_ms_p50"]] for r in result["sizes"]],
    )  # fmt: skip
    c = weights_scale.table(result["scale"]) if result.get("scale") else ""
    return (
        f"Notice latency (sim rollout engines, tiny checkpoint):\n\n{a}\n\nLoad time by checkpoint size (hf engine):"
        f"\n\n{b}\n\nModel scale (synthetic bf16 Llama state dicts; rollout workers as processes):\n\n{c}"
    )


def plot(out: Path, result: dict) -> list[Path]:
    if (plt := pyplot()) is None:
        return []
    rows = [r for r in result["sizes"] if r.get("checkpoint_MB")]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    mb = [r["checkpoint_MB"] for r in rows]
    for key, label in (
        ("trainer_write_ms_p50", "trainer write"),
        ("fetch_verify_ms_p50", "worker fetch + sha256"),
        ("swap_ms_p50", "worker swap"),
        ("all_loaded_ms_p50", "publish → all loaded"),
    ):
        ax.plot(mb, [r.get(key) or float("nan") for r in rows], "o-", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint size (MB, safetensors fp32)")
    ax.set_ylabel("ms (p50)")
    ax.set_title("weight update cost by checkpoint size", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    p = out / "weights.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]
