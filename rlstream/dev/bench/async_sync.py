"""Benchmark 1, async vs sync: the same workers and the same total work (``trainer.max_steps``
steps of G groups of n samples), with max staleness k in {0, 1, 2, 4}; k = 0 is synchronous RL.

Two engines:

* ``sim`` (a load generator, not a model): the rollout engine decodes at ``token_latency_s`` per step
  under continuous batching with heavy-tailed response lengths, the train engine sleeps a cost per
  trained token; everything else is the real pipeline (feed, rollout workers with admission and
  interrupt-reload, reward, the trainer worker with staleness gate, checkpoints and WeightUpdates).
  The train cost is set so training capacity equals generation capacity, and the ideal-overlap
  bound ``min(generation, training capacity)`` is computed from the configured rates.
  Workloads: ``long-tail`` (lognormal, sigma 0.5, plus 3% of the samples at the clip of 8x the
  median: a few very long responses per batch, the case queue scheduling exists for) and, as a
  contrast, ``uniform`` (sigma 0.25, no long samples; k in {0, 1} only).
* ``hf``: the real tiny model with the hf rollout engine and the torch trainer on this CPU, with
  per-prompt token budgets drawn from the same kind of long-tailed distribution.

Per run it reports, over the steady-state window (the last 3/4 of the steps; the pipeline fills first):
samples/s and tokens/s trained, trainer idle fraction (no train step running), rollout idle fraction
(decode slots empty: 1 - mean in-flight samples / max_inflight), samples dropped as stale, speedup
over k = 0, and achieved/ideal. It prints figures; it asserts nothing.

The staleness rule: every run uses the resolved ``rl.staleness_rule`` (``--set
rl.staleness_rule=token`` runs everything under the token rule), and the sizes' ``token_ks``
add, for the sim engine's long-tail workload, runs under the token rule next to the sample rule's
(rows marked ``rule = token``). Whole-run waste figures compare the two: samples and response
tokens dropped as stale, tokens masked by the token rule, and the partial rollouts generated (a
trajectory whose versions span a weight load: what the token rule can keep part of; with
``reload_policy = "interrupt"`` the sim engine resumes an aborted sample under the new version).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from rlstream.dev.bench.harness import (
    BenchContext,
    log_line,
    make_config,
    md_table,
    metric_events,
    pyplot,
    read_topic,
    rnd,
    run_pipeline,
    summarize_profile,
    write_json,
)

WORKLOADS = {
    "uniform": {"sigma": 0.25, "long_fraction": 0.0},
    "long-tail": {"sigma": 0.5, "long_fraction": 0.03},
}
SIZES = {
    "tiny": {  # the CI smoke test: one rollout worker, a few steps
        "sim": {"steps": 4, "groups": 2, "n": 4, "workers": 1, "inflight": 8, "latency": 0.01, "median": 8,
                "clip": 32, "ks": [0, 1], "workloads": ["long-tail"], "overprovision": [(1, "sample", 1)]},
        "hf": {"steps": 3, "groups": 2, "n": 4, "workers": 1, "inflight": 8, "median": 6, "clip": 24, "ks": [0]},
    },
    "full": {
        "sim": {"steps": 16, "groups": 8, "n": 8, "workers": 2, "inflight": 16, "latency": 0.02, "median": 12,
                "clip": 96, "ks": [0, 1, 2, 4], "workloads": ["long-tail", "uniform"], "uniform_ks": [0, 1],
                "token_ks": [1, 2], "overprovision": [(2, "token", 1), (2, "sample", 1), (2, "token", 1, "train"),
                                                      (2, "sample", 1, "train")],
                # the trained tail at the default rows' 8 draws a prompt: groups close at 6 of 8
                "quorum": [(2, "token", 2, "train", 6), (2, "sample", 2, "train", 6)]},
        "hf": {"steps": 40, "groups": 4, "n": 8, "workers": 2, "inflight": 16, "median": 16, "clip": 128,
               "ks": [0, 1, 2, 4]},
    },
}  # fmt: skip
PROMPT_TOKENS = 8
"""Every prompt is 8 characters, i.e. 8 tokens of the character-level tiny model."""
SMALL_MODEL = {
    "model.hidden_size": 64,
    "model.intermediate_size": 128,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.max_position_embeddings": 256,
}


def write_prompts(path: Path, count: int, budgets: list[int] | None = None) -> Path:
    with open(path, "w") as f:
        for i in range(count):
            rec = {"id": f"q{i}", "prompt": f"q{i:06d}:", "task": "bench", "reference": {"answer": "x"}}
            if budgets:
                rec["max_new_tokens"] = budgets[i]
            f.write(json.dumps(rec) + "\n")
    return path


def common_sets(sz: dict, k: int, source: Path) -> dict[str, Any]:
    g = sz["groups"]
    return {
        "rl.group_size": sz["n"],
        "rl.groups_per_step": g,
        "rl.max_staleness": k,
        "topics.prompts.partitions": 8,
        "topics.rollouts.partitions": 4,
        "topics.scored.partitions": 2,
        "feed.source": str(source),
        "feed.epochs": 100000,
        "feed.limit": (sz["steps"] + 6) * g,
        # paced as the examples run it, with the defaults' lead of one step and backlog of 8
        # (without them: 56 samples/s at k = 4 against 81 publishing every group up front)
        "feed.dispatch": "paced",
        "rollout.max_inflight": sz["inflight"],
        "rollout.max_new_tokens": sz["clip"],
        "rollout.reload_policy": "interrupt",
        "rollout.stale_restarts": 1,
        "rollout.metrics_interval_s": 1,
        "rollout.poll_timeout_s": 0.02,
        "kafka.consumer": {"fetch.wait.max.ms": 50},
        "reward.executor": "thread",
        "reward.pool_size": 1,
        "reward.max_batch_ms": 20,
        "reward.batch_idle_ms": 5,
        "reward.max_batch_size": 128,
        "reward.timeout_s": 2,
        "reward.metrics_interval_s": 2,
        "trainer.max_steps": sz["steps"],
        "trainer.group_timeout_s": 600,
        "trainer.metrics_interval_s": 1,
        "trainer.poll_timeout_s": 0.05,
        "trainer.keep_weight_versions": 3,
        "trainer.keep_checkpoints": 1,
        **SMALL_MODEL,
    }


def sim_engine(sz: dict, workload: str):
    """The rollout sim engine's config for a size and workload (``SimEngineConfig``)."""
    from producers.config import SimEngineConfig

    return SimEngineConfig(
        token_latency_s=sz["latency"], median_tokens=sz["median"], clip_tokens=sz["clip"], **WORKLOADS[workload]
    )


def sim_plan(sz: dict, workload: str, balance: float = 1.0) -> tuple[dict[str, Any], dict]:
    """The sim engines' settings and the ideal-overlap bound they imply."""
    from libs.engines.sim import expected_length

    eng = sim_engine(sz, workload)
    mean_len = expected_length(eng, sz["clip"], 50_000)
    slots = sz["workers"] * sz["inflight"]
    gen = slots / (sz["latency"] * mean_len)
    token_cost = 1.0 / (gen * balance * (PROMPT_TOKENS + mean_len))
    train = 1.0 / (token_cost * (PROMPT_TOKENS + mean_len))
    sets = {
        "rollout.engine": {k: v for k, v in eng.model_dump().items() if v is not None},
        "trainer.engine": {"type": "sim", "token_cost_s": token_cost},
        "trainer.micro_batch_size": sz["groups"] * sz["n"],
    }
    plan = {
        "mean_response_tokens": round(mean_len, 2),
        "generation_capacity_samples_per_s": round(gen, 2),
        "training_capacity_samples_per_s": round(train, 2),
        "ideal_samples_per_s": round(min(gen, train), 2),
        "token_latency_s": sz["latency"],
        "train_token_cost_s": token_cost,
        "decode_slots": slots,
    }
    return sets, plan


def hf_budgets(sz: dict, count: int, seed: int = 0) -> list[int]:
    """Per-prompt token budgets: lognormal (sigma 0.5) plus 3% at the clip, like the sim long tail."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = sz["clip"] if rng.random() < 0.03 else round(sz["median"] * math.exp(0.5 * rng.gauss(0, 1)))
        out.append(max(1, min(n, sz["clip"])))
    return out


def analyze(cfg, run_dir: Path, workers: int, inflight: int) -> dict:
    """Steady-state figures of one finished run. Window: from the end of step ``S // 4`` (at least
    step 1; the pipeline fills before it) to the end of the last step S."""
    from consumers.trainer.state import read_steps_log

    steps = read_steps_log(run_dir / "trainer")
    trajs: dict[str, dict] = {}
    for _, _, _, t in read_topic(cfg, "rollouts", "Trajectory"):
        trajs[t["trajectory_id"]] = {
            "worker": t["worker_id"],
            "start": t["gen_started_at_ms"] / 1e3,
            "end": t["gen_finished_at_ms"] / 1e3,
            "tokens": len(t["response_tokens"]) // 4,
            "partial": t["version_max"] > t["version_min"],
        }
    out: dict = {"steps_completed": len(steps), "trajectories_generated": len(trajs)}
    out["stale_dropped"] = sum(len(s.get("stale", [])) for s in steps)
    out.update(waste(steps, trajs))
    out["incomplete_dropped"] = sum(len(s.get("incomplete_dropped", [])) for s in steps)
    hist: dict[str, int] = {}
    for s in steps:
        for d, n in s.get("staleness", {}).items():
            hist[d] = hist.get(d, 0) + n
    out["staleness_histogram"] = dict(sorted(hist.items(), key=lambda x: int(x[0])))
    if len(steps) < 2:
        return out
    skip = max(1, len(steps) // 4)
    t0, t1 = steps[skip - 1]["time"], steps[-1]["time"]
    window = t1 - t0
    counted = steps[skip:]
    used = [tid for s in counted for tid in s["used"]]
    samples = len(used)
    tokens = sum(trajs[t]["tokens"] for t in used if t in trajs)
    busy = sum(s["step_time_s"] for s in counted)
    ckpt, publish_ms = _checkpoint_seconds(cfg, t0, t1)
    slot_s, worker_busy = 0.0, {}
    for t in trajs.values():
        a, b = max(t["start"], t0), min(t["end"], t1)
        if b > a:
            slot_s += b - a
            worker_busy.setdefault(t["worker"], []).append((a, b))
    gen_in_window = sum(1 for t in trajs.values() if t0 < t["end"] <= t1)
    cum, timeline = 0, []
    for s in steps:
        cum += len(s["used"])
        timeline.append([round(s["time"] - steps[0]["time"], 3), cum])
    out.update(
        {
            "timeline": timeline,
            "window_s": rnd(window),
            "samples_trained": samples,
            "samples_per_s": rnd(samples / window),
            "tokens_per_s": rnd(tokens / window, 1),
            "generated_samples_per_s": rnd(gen_in_window / window),
            "trainer_idle_fraction": rnd(1 - busy / window),
            "trainer_checkpoint_fraction": rnd(ckpt / window) if ckpt is not None else None,
            "trainer_publish_ms_mean": rnd(sum(publish_ms) / len(publish_ms), 1) if publish_ms else None,
            "rollout_idle_fraction": rnd(1 - slot_s / (workers * inflight * window)),
            "rollout_worker_empty_fraction": rnd(
                1 - sum(_union(iv) for iv in worker_busy.values()) / (workers * window)
            ),
            "window_steps": f"{skip + 1}-{len(steps)}",
            "step_period_s": rnd(window / len(counted)),
            "mean_step_time_s": rnd(busy / len(counted)),
            "mean_response_tokens_trained": rnd(tokens / samples if samples else float("nan"), 1),
        }
    )
    return out


def waste(steps: list[dict], trajs: dict[str, dict]) -> dict:
    """Whole-run staleness waste: response tokens of the samples dropped as stale, tokens the token
    rule masked (and in how many trained samples), and the partial rollouts generated and trained."""
    stale = [t for s in steps for t in s.get("stale", [])]
    masked = [c for s in steps for c in (s.get("token_masked") or {}).values()]
    used = {t for s in steps for t in s.get("used", [])}
    return {
        "stale_dropped_tokens": sum(trajs[t]["tokens"] for t in stale if t in trajs),
        "tokens_masked": sum(c["masked"] for c in masked),
        "samples_token_masked": len(masked),
        "partial_rollouts": sum(1 for t in trajs.values() if t["partial"]),
        "partial_rollouts_trained": sum(1 for t, v in trajs.items() if v["partial"] and t in used),
    }


def _checkpoint_seconds(cfg, t0: float, t1: float) -> tuple[float | None, list[float]]:
    """Checkpoint + publish seconds in the window, and each WeightUpdate's publish (produce and
    wait for the ack) in ms, from the trainer's per-step gauges."""
    seen, total, publish = set(), 0.0, []
    for ev in metric_events(cfg):
        m = ev["metrics"]
        if ev["role"] != "trainer" or "step" not in m or "trainer_ckpt_ms" not in m:
            continue
        if not t0 < ev["timestamp_ms"] / 1e3 <= t1 + 1 or m["step"] in seen:
            continue
        seen.add(m["step"])
        total += (m.get("weights_write_ms", 0) + m["trainer_ckpt_ms"] + m.get("publish_ms", 0)) / 1e3
        if "publish_ms" in m:
            publish.append(m["publish_ms"])
    return (total if seen else None), publish


ROLLOUT_TOTALS = ("restarted_samples", "restart_discarded_tokens", "regenerated_samples", "regenerate_discarded_tokens",
                  "overprovision_aborted_samples", "overprovision_discarded_tokens")  # fmt: skip


def rollout_totals(cfg, names: tuple[str, ...] = ROLLOUT_TOTALS) -> dict:
    """The rollout workers' final cumulative counters (summed over workers), from rl.metrics."""
    last: dict[str, dict] = {}
    for ev in metric_events(cfg):
        if ev["role"] == "rollout":
            last[ev["worker_id"]] = ev["metrics"]
    return {n: int(sum(m.get(n, 0) for m in last.values())) for n in names}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def run_one(
    ctx: BenchContext,
    engine: str,
    workload: str,
    k: int,
    rule: str | None = None,
    extra: int = 0,
    tail: str = "abort",
    quorum: int | None = None,
) -> dict:
    """One pipeline run; ``rule`` sets ``rl.staleness_rule`` (None: the resolved config's),
    ``extra`` ``rollout.overprovision``, ``tail`` ``rollout.overprovision_tail``, ``quorum``
    ``rl.group_size`` (the size's ``n`` when None: with ``extra``, a group is drawn ``quorum + extra``
    strong and closes at ``quorum``)."""
    sz = SIZES[ctx.size][engine]
    name = f"async-{engine}-{workload}-k{k}" + (f"-{rule}" if rule else "") + (f"-over{extra}" if extra else "")
    name += "-tail" if extra and tail == "train" else ""
    name += f"-q{quorum}" if quorum else ""
    run_dir = ctx.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    count = 64
    plan: dict = {}
    if engine == "sim":
        source = write_prompts(run_dir / "prompts.jsonl", count)
        sets, plan = sim_plan(sz, workload)
    else:
        source = write_prompts(run_dir / "prompts.jsonl", count, hf_budgets(sz, count))
        sets = {
            "rollout.engine": {"type": "hf", "device": "cpu", "threads": 1, "refill_every": 4},
            "trainer.engine": {"type": "torch", "device": "cpu"},
            "trainer.micro_batch_size": sz["groups"] * sz["n"],
            "trainer.lr": 0.0003,
        }
    rule_sets = {"rl.staleness_rule": rule} if rule else {}
    if extra:
        rule_sets["rollout.overprovision"] = extra
        rule_sets["rollout.overprovision_tail"] = tail
    if quorum:
        rule_sets["rl.group_size"] = quorum
    cfg, path = make_config(ctx, name, {**common_sets(sz, k, source), **sets, **rule_sets})
    res = run_pipeline(ctx, cfg, path, sz["workers"], 1, timeout_s=900, profile=["trainer", "rollout-0", "reward-0"])
    row = {"engine": engine, "workload": workload, "k": k, "rule": cfg.rl.staleness_rule, "overprovision": extra}
    row["overprovision_tail"] = tail if extra else None
    row["quorum"] = cfg.rl.group_size if extra else None
    row.update(status=res.status, wall_s=res.wall_s)
    row["loadavg"] = res.loadavg
    row.update(analyze(cfg, Path(cfg.run_dir), sz["workers"], sz["inflight"]))
    row.update(rollout_totals(cfg))
    if plan:
        row["plan"] = plan
        row["achieved_over_ideal"] = rnd((row.get("samples_per_s") or 0) / plan["ideal_samples_per_s"])
        ideal_tokens = plan["ideal_samples_per_s"] * plan["mean_response_tokens"]
        row["tokens_over_ideal"] = rnd((row.get("tokens_per_s") or 0) / ideal_tokens)
    if res.profiles:
        row["profiles"] = {n: summarize_profile(p) for n, p in res.profiles.items()}
        row["kafka_share"] = kafka_share(row)
    log_line(
        ctx, name, status=res.status, samples_per_s=row.get("samples_per_s"), stale=row.get("stale_dropped"),
        restarted=row.get("restarted_samples"), regenerated=row.get("regenerated_samples"),
        tokens_masked=row.get("tokens_masked"), partial_rollouts=row.get("partial_rollouts"),
        achieved_over_ideal=row.get("achieved_over_ideal"), wall_s=res.wall_s,
    )  # fmt: skip
    return row


def kafka_share(row: dict) -> dict:
    """Kafka's share of the step time: per trainer step, the CPU the trainer and one rollout worker
    spent in Kafka client calls and Avro coding (py-spy), plus the trainer's wait for the
    WeightUpdate's ack (``publish_ms``), over the steady-state step period."""
    steps, period = row.get("steps_completed") or 0, row.get("step_period_s")
    if not steps or not period:
        return {}
    out = {}
    for name, prof in row["profiles"].items():
        ms = prof["phase_cpu_s"]["kafka+avro"] * 1e3 / steps
        if name == "trainer":
            ms += row.get("trainer_publish_ms_mean") or 0.0
        out[name] = {"ms_per_step": rnd(ms, 1), "share_of_step": rnd(ms / (period * 1e3))}
    return out


def hf_ideal(rows: list[dict], sz: dict) -> dict | None:
    """For the real engines: capacities measured in isolation in the k = 0 run, where generation
    and training alternate (generation: samples per second of rollout-busy time; training: samples
    per second of train-step time)."""
    base = next((r for r in rows if r["k"] == 0 and r.get("samples_per_s")), None)
    if base is None:
        return None
    busy_share = 1 - base["rollout_worker_empty_fraction"]
    gen = base["generated_samples_per_s"] / busy_share if busy_share > 0 else None
    train = base["samples_per_s"] / (1 - base["trainer_idle_fraction"]) if base["trainer_idle_fraction"] < 1 else None
    if not gen or not train:
        return None
    return {
        "generation_capacity_samples_per_s": round(gen, 2),
        "training_capacity_samples_per_s": round(train, 2),
        "ideal_samples_per_s": round(min(gen, train), 2),
        "how": "measured in the k = 0 run, where generation and training alternate",
    }


ROW_FAMILIES = ("default", "token", "overprovision", "quorum")
"""``--rules`` for this bench: which rows to run (the default rule at every k, the token rule's rows,
the over-provisioned rows, the over-provisioned rows at the default rows' draws a prompt); all by
default."""


def run(ctx: BenchContext, engines: list[str] | None = None) -> dict:
    engines = engines or ["sim", "hf"]
    rows = []
    rows_wanted = set(ctx.extra.get("rules") or ROW_FAMILIES)
    if rows_wanted - set(ROW_FAMILIES):
        raise ValueError(
            f"bench async --rules: unknown {sorted(rows_wanted - set(ROW_FAMILIES))}; one of {ROW_FAMILIES}"
        )
    for engine in engines:
        sz = SIZES[ctx.size][engine]
        for workload in sz.get("workloads", ["long-tail"]):
            ks = sz.get(f"{workload}_ks", sz["ks"])
            group = [run_one(ctx, engine, workload, k) for k in ks] if "default" in rows_wanted else []
            if engine == "sim" and workload == "long-tail":
                if "token" in rows_wanted:
                    group += [run_one(ctx, engine, workload, k, "token") for k in sz.get("token_ks", [])]
                if "overprovision" in rows_wanted:
                    group += [run_one(ctx, engine, workload, *row) for row in sz.get("overprovision", [])]
                if "quorum" in rows_wanted:
                    group += [run_one(ctx, engine, workload, *row) for row in sz.get("quorum", [])]
            if not group:
                continue
            base = next((r.get("samples_per_s") for r in group if r["k"] == 0), None)
            if engine == "hf":
                ideal = hf_ideal(group, sz)
                for r in group:
                    r["plan"] = ideal
                    if ideal:
                        r["achieved_over_ideal"] = rnd((r.get("samples_per_s") or 0) / ideal["ideal_samples_per_s"])
            for r in group:
                r["speedup_over_k0"] = rnd((r.get("samples_per_s") or 0) / base) if base else None
            rows.extend(group)
    result = {"benchmark": "async", "size": ctx.size, "sizes": SIZES[ctx.size], "workloads": WORKLOADS, "runs": rows}
    write_json(ctx.out / "async.json", result)
    result["plots"] = [str(p) for p in plot(ctx.out, rows)]
    write_json(ctx.out / "async.json", result)
    return result


def table(result: dict) -> str:
    headers = ["engine", "workload", "k", "rule", "samples/s", "tokens/s", "trainer idle", "rollout idle",
               "stale dropped", "stale tokens", "restarted (tokens discarded)", "regenerated (tokens discarded)",
               "tokens thrown away", "tokens masked", "partial rollouts", "speedup vs k=0", "achieved/ideal",
               "overprovision (aborted)", "trained tokens/ideal", "mean tokens trained"]  # fmt: skip
    rows = [
        [r["engine"], r["workload"], r["k"], r.get("rule", "sample"), r.get("samples_per_s"), r.get("tokens_per_s"),
         r.get("trainer_idle_fraction"), r.get("rollout_idle_fraction"), r.get("stale_dropped"),
         r.get("stale_dropped_tokens"), _restarts(r, "restarted_samples", "restart_discarded_tokens"),
         _restarts(r, "regenerated_samples", "regenerate_discarded_tokens"), _thrown_away(r), r.get("tokens_masked"),
         r.get("partial_rollouts"),
         r.get("speedup_over_k0"), r.get("achieved_over_ideal"),
         _overprovision(r),
         r.get("tokens_over_ideal"), r.get("mean_response_tokens_trained")]
        for r in result["runs"]
    ]  # fmt: skip
    return md_table(headers, rows)


def _overprovision(r: dict):
    """The over-provisioning column: 0 (off), the aborted samples (their tokens), or the tail trained."""
    if not r.get("overprovision"):
        return 0
    if r.get("overprovision_tail") == "train":
        q = r.get("quorum")
        drawn = f"quorum {q} of {q + r['overprovision']}" if q else f"+{r['overprovision']}"
        return f"{drawn}, tail trained"
    return _restarts(r, "overprovision_aborted_samples", "overprovision_discarded_tokens")


def _restarts(r: dict, samples: str, tokens: str) -> str | None:
    if r.get(samples) is None:
        return None
    return f"{r[samples]} ({r.get(tokens, 0)})"


def _thrown_away(r: dict) -> int | None:
    """Generated tokens no step trained: stale-dropped samples', those the token rule masked, and
    those discarded by restarts."""
    if r.get("stale_dropped_tokens") is None:
        return None
    parts = ("stale_dropped_tokens", "tokens_masked", "restart_discarded_tokens", "regenerate_discarded_tokens",
             "overprovision_discarded_tokens")  # fmt: skip
    return sum(r.get(n) or 0 for n in parts)


def plot(out: Path, rows: list[dict]) -> list[Path]:
    if (plt := pyplot()) is None:
        return []
    groups: dict[str, list[dict]] = {}
    for r in rows:
        rule = " / token rule" if r.get("rule") == "token" else ""
        rule += f" / overprovision {r['overprovision']}" if r.get("overprovision") else ""
        rule += " tail" if r.get("overprovision_tail") == "train" else ""
        rule += f" quorum {r['quorum']}" if r.get("quorum") and r.get("overprovision_tail") == "train" else ""
        groups.setdefault(f"{r['engine']} / {r['workload']}{rule}", []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (title, rs) in zip(axes[0], groups.items(), strict=True):
        ks = [str(r["k"]) for r in rs]
        ax.bar(ks, [r.get("samples_per_s") or 0 for r in rs], color="#4c72b0")
        ideal = (rs[0].get("plan") or {}).get("ideal_samples_per_s")
        if ideal:
            ax.axhline(ideal, color="#c44e52", ls="--", lw=1.2, label=f"ideal overlap {ideal:.0f}/s")
            ax.legend(loc="lower right", fontsize=8)
        for i, r in enumerate(rs):
            if r.get("speedup_over_k0"):
                ax.text(
                    i,
                    (r.get("samples_per_s") or 0),
                    f"{r['speedup_over_k0']:.2f}x",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("max staleness k (0 = sync)")
        ax.set_ylabel("samples/s trained")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p1 = out / "async-throughput.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    title, rs = next(iter(groups.items()))  # the first engine/workload: samples trained over time, per k
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in rs:
        if r.get("timeline"):
            ax.plot([t for t, _ in r["timeline"]], [n for _, n in r["timeline"]], "o-", ms=2.5, label=f"k = {r['k']}")
    ax.set_xlabel("seconds since trainer step 1")
    ax.set_ylabel("samples trained")
    ax.set_title(f"{title}: samples trained over time", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p2 = out / "async-timeline.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]
