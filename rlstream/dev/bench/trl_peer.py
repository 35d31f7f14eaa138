"""``rlstream bench trl``: the real-model recipe in Hugging Face TRL's ``GRPOTrainer`` beside rlstream,
on the same machine, run in turn (TRL, rlstream, TRL, ... with ``repeats``), each for the same
wall-clock budget: the peer users would otherwise use on one machine.

Matched from the recipe's resolved config: the model directory (the same imported weights), the
generated train and held-out records (chat messages, the same reference), the reward (the recipe's
``reward.tasks`` through the project's own ``TaskRouter``), group size (``num_generations``), prompts
per optimizer step (``per_device_train_batch_size = group_size * groups_per_step``, one optimizer
step per generation batch, ``num_iterations = 1``), learning rate with the same warm-up and a constant
schedule, gradient clipping, AdamW betas/eps/weight decay, max new tokens, temperature (top-k and
top-p off), bf16 autocast when the recipe's trainer uses it, and the held-out eval (greedy pass@1 on
the same prompts every ``eval.every_versions`` optimizer steps).

Semantic differences, stated because they are not removable: TRL is synchronous (generation, then
the update, in one process: rlstream's k = 0 without Kafka); its loss is ``dapo`` (token-level
clipped surrogate normalised over the batch's tokens, which is rlstream's ``ppo_clip`` with
``token-mean`` aggregation) with ``beta = 0`` (no KL, as the recipe); its advantages are GRPO's
(group mean and std); its generation is ``transformers.generate`` with the whole batch padded, while
rlstream's hf engine batches continuously. TRL's eval pauses its training clock (it runs inline);
rlstream's eval runs as a process of its own and shares the two cores.

Per run it reports wall time to ``v0 + target_gain`` held-out pass@1, the final and best pass@1,
optimizer steps, samples trained, and samples per CPU-second (all processes of the run, from
``getrusage(RUSAGE_CHILDREN)``, plus the bench broker's CPU during rlstream runs, ``broker_cpu_s``:
a user's run needs its broker). It prints figures and asserts nothing. The TRL process itself and the
matching of settings it shares with ``rlstream bench peer``: ``rlstream.dev.bench.trl_grpo``.
"""

from __future__ import annotations

import json
import os

from pipeline.models import resolve_dtype
from rlstream.dev.bench import learn
from rlstream.dev.bench.harness import (
    REPO,
    BenchContext,
    cpu_children,
    cpu_seconds,
    cpu_since,
    in_plan,
    md_table,
    resume,
    schedule,
    write_json,
)
from rlstream.dev.bench.trl_grpo import require_trl, run_child

SIZES = {
    "tiny": {"recipe": learn.SIZES["tiny"]["recipe"], "budget_s": 60, "repeats": 1, "k": 1,
             "sets": learn.SIZES["tiny"]["sets"], "target_gain": 0.2},
    "full": {"recipe": learn.SIZES["full"]["recipe"], "budget_s": 3600, "repeats": 1, "k": 1, "sets": [],
             "target_gain": 0.2},
}  # fmt: skip


def trl_spec(ctx: BenchContext, name: str, sz: dict, seed: int | None = None) -> dict:
    """What the TRL run needs, taken from the recipe's resolved config (with ``seed``'s settings)."""
    from pipeline.models import materialize
    from rlstream.job import resolve

    seeded = [] if seed is None else learn.seed_sets(seed)
    sets = [*ctx.base_sets, *sz["sets"], *seeded, f"job.name={name}", f"run_dir={json.dumps(str(ctx.out / 'trl'))}"]
    cfg = resolve(sz["recipe"], sets, bootstrap="unused:1")
    t, o = cfg.trainer, cfg.trainer.optim
    return {
        "model_dir": str(materialize(cfg.model)),
        "train": str(cfg.feed.source),
        "eval": str(cfg.eval.source),
        "reward": cfg.reward.model_dump(mode="json"),
        "group_size": cfg.rl.group_size,
        "groups_per_step": cfg.rl.groups_per_step,
        "lr": t.lr,
        "warmup_steps": o.warmup_steps,
        "grad_clip": o.grad_clip,
        "betas": list(o.betas),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        "bf16": resolve_dtype(getattr(t.engine, "dtype", "float32"), "cpu") == "bfloat16",
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
        "eval_every": cfg.eval.every_versions,
        "eval_prompts": cfg.eval.max_prompts,
        "eval_max_new_tokens": cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        "seed": t.seed,
        "budget_s": sz["budget_s"],
        "threads": os.cpu_count() or 1,
        "out": str(ctx.out / "trl" / f"{name}.json"),
        "work_dir": str(ctx.out / "trl" / name),
    }


def run_trl(ctx: BenchContext, name: str, sz: dict, seed: int | None = None) -> dict:
    spec = trl_spec(ctx, name, sz, seed)
    ctx.say(f"[bench] trl {name}: seed {spec['seed']}, budget {sz['budget_s']} s")
    load0 = os.getloadavg()[0]
    got = run_child(spec, timeout_s=sz["budget_s"] * 2 + 600)
    res = learn.summarize(got["curve"], [], sz["target_gain"])
    samples = got["steps"] * spec["group_size"] * spec["groups_per_step"]
    cpu, rc = got["cpu_s"], got["returncode"]
    return {**res, "engine": "trl", "name": name, "seed": seed, "status": "ok" if rc == 0 else f"exit {rc}",
            "wall_s": round(got["wall_s"], 1), "steps": got["steps"], "samples_trained": samples,
            "cpu_s": round(cpu, 1), "samples_per_cpu_s": round(samples / cpu, 3) if cpu else None,
            "eval_s": got.get("eval_s"), "curve": got["curve"], "loadavg_at_start": round(load0, 2)}  # fmt: skip


def run_rlstream(ctx: BenchContext, name: str, sz: dict, seed: int | None = None) -> dict:
    cpu0, b0 = cpu_children(), cpu_seconds(ctx.broker_pid)
    r = learn.run_one(ctx, name, sz["k"], {**learn.SIZES[ctx.size], **sz, "steps": 100_000}, seed)
    broker = round(cpu_since(ctx.broker_pid, b0), 1)
    cpu = cpu_children() - cpu0 + broker
    return {**r, "engine": f"rlstream k={sz['k']}", "cpu_s": round(cpu, 1), "broker_cpu_s": broker,
            "samples_per_cpu_s": round(r["samples_trained"] / cpu, 3) if cpu else None}  # fmt: skip


def preflight() -> None:
    require_trl("trl")


def run_key(r: dict) -> tuple:
    """A run's place in the plan: ``(seed, repeat, "trl" | "rlstream")``."""
    return (r["seed"], r.get("repeat", 0), r["engine"].split()[0])


def run(ctx: BenchContext) -> dict:
    require_trl("trl")
    sz = {**SIZES[ctx.size], **({"budget_s": ctx.extra["budget_s"]} if ctx.extra.get("budget_s") else {})}
    seeds = list(ctx.extra.get("seeds") or [None])  # None: the recipe's own seeds
    path = ctx.out / "trl.json"
    plan = schedule(["trl", "rlstream"], seeds, sz["repeats"])
    runs, todo = resume(path, plan, run_key, learn.completed, ctx.say)
    for seed, r, which in todo:
        name = f"peer-{ctx.run_id}-{which}" + ("" if seed is None else f"-s{seed}") + f"-r{r}"
        run_arm = run_trl if which == "trl" else run_rlstream
        runs.append({**run_arm(ctx, name, sz, seed), "repeat": r})
        write_json(path, {"benchmark": "trl", "runs": runs})
    mine, others = in_plan(runs, plan, run_key)
    result = {"benchmark": "trl", "size": ctx.size, "recipe": str(sz["recipe"].relative_to(REPO)),
              "budget_s": sz["budget_s"], "target_gain": sz["target_gain"], "seeds": seeds, "runs": mine,
              "other_runs": others}  # fmt: skip
    result["by_engine"] = learn.over_seeds(mine, lambda r: r["engine"], sz["budget_s"])
    result["plots"] = [str(p) for p in plot(ctx.out, result)]
    write_json(path, result)
    return result


def plot(out, result: dict) -> list:
    """Held-out pass@1 of every run against time (TRL's training clock, rlstream's from launch) and
    against samples trained: ``trl.png`` in ``out``."""

    def label(r: dict) -> str:
        return r["engine"] + ("" if r.get("seed") is None else f", seed {r['seed']}")

    return learn.plot_curves(
        out / "trl.png", result["runs"], label, f"TRL GRPOTrainer and rlstream: {result['recipe']}"
    )


def table(result: dict) -> str:
    seeded = any(r.get("seed") is not None for r in result["runs"])
    brokered = any("broker_cpu_s" in r for r in result["runs"])  # results files written without it lack it
    runs = md_table(
        ["engine", *(["seed"] if seeded else []), "status", "steps", "samples", "samples / CPU-s",
         *(["broker CPU s"] if brokered else []), "pass@1 v0", "final (version)", "best",
         f"time to v0 + {result['target_gain']:g}", "load avg at start"],
        [[r["engine"], *([r.get("seed")] if seeded else []), r["status"], r["steps"], r["samples_trained"],
          r["samples_per_cpu_s"], *([r.get("broker_cpu_s", "-")] if brokered else []), r["pass_at_1_v0"],
          f"{r['pass_at_1_final']} (v{r['final_version']})", r["pass_at_1_best"],
          "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s", r["loadavg_at_start"]]
         for r in result["runs"]],
    )  # fmt: skip
    agg = result.get("by_engine")
    if not agg or not any(s["n"] > 1 for s in agg["arms"].values()):
        return runs
    return f"{runs}\n\n{learn.arms_table(agg, result['target_gain'], 'engine')}"
