"""``rlstream bench learn``: staleness against quality. The same recipe (same seeds, data, model and
hyper-parameters) runs at several ``rl.max_staleness`` values, one after another (with ``repeats``
the order alternates), each for a wall-clock budget; the held-out eval curve of every run is then
read back and set against wall time and against samples trained.

Per run it reports: held-out pass@1 of version 0 and of the last evaluated version, the best, the
wall time and samples until pass@1 first reached ``v0 + target_gain`` (``-`` if never), steps done,
samples trained, and samples dropped as stale. A version's point in time is the moment the trainer
step that produced it ended (from the steps log), so the eval process's own lag does not count.

Each run is a whole ``rlstream run`` job (its own topics and run dir under the bench's directory)
on the bench's broker, stopped with SIGTERM when its budget is spent. At k = 0 generation and
training alternate, so the rollout engine and the trainer get every core (``threads``); at k > 0 they
overlap and keep one thread each (the launcher's ``OMP_NUM_THREADS=1``). Sizes: ``tiny`` (the tiny
model's arithmetic job, about a minute per run: a smoke test of the harness, not of learning) and
``full`` (examples/smollm2-chain-sum.toml, 60 minutes per run, k = 0, 1, 2: the documented run).
It prints figures and asserts nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlstream.dev.bench.harness import (
    REPO,
    BenchContext,
    child_env,
    cpu_children,
    in_plan,
    md_table,
    mean_ci,
    metric_events,
    pyplot,
    resume,
    rnd,
    save_figure,
    schedule,
    write_json,
)

SIZES = {
    "tiny": {
        "recipe": REPO / "examples" / "arithmetic.toml",
        "ks": [0, 1],
        "budget_s": 90,
        "repeats": 1,
        "steps": 40,
        "target_gain": 0.2,
        "sets": ["eval.every_versions=10", "job.metrics_port_base=0"],
    },
    "full": {
        "recipe": REPO / "examples" / "smollm2-chain-sum.toml",
        "ks": [0, 1, 2],
        "budget_s": 3600,
        "repeats": 1,
        "steps": 100_000,
        "target_gain": 0.2,
        "sets": [],
    },
}


def seed_sets(seed: int) -> list[str]:
    """The settings that make a run's data order, sampling and initial draws depend on ``seed``."""
    return [f"feed.shuffle_seed={seed}", f"rollout.engine.seed={seed}", f"trainer.seed={seed}"]


def at_samples(curve: list[dict], samples: int) -> float | None:
    """pass@1 of the last evaluated version trained on at most ``samples`` samples."""
    seen = [c for c in curve if c["samples"] <= samples]
    return seen[-1]["pass_at_1"] if seen else None


def _job_sets(ctx: BenchContext, name: str, k: int, sz: dict, subdir: str = "learn") -> list[str]:
    # k = 0 alternates generation and training, so each may use every core; with k > 0 they overlap
    # and keep the launcher's one thread per process (``sync_threads = False``: the launcher's always)
    cores = os.cpu_count() or 1
    sync = [f"rollout.engine.threads={cores}", f"trainer.engine.threads={cores}"]
    sync = sync if k == 0 and sz.get("sync_threads", True) else []
    return [
        *ctx.base_sets,
        *sz["sets"],
        *sync,
        f"job.name={name}",
        f"run_dir={json.dumps(str(ctx.out / subdir))}",
        f"rl.max_staleness={k}",
        f"kafka.bootstrap_servers={ctx.bootstrap}",
    ]


def run_job(ctx: BenchContext, name: str, k: int, sz: dict, subdir: str = "learn") -> dict:
    """``rlstream run <sz["recipe"]> --steps <sz["steps"]>`` at staleness ``k`` as a child process, in
    ``<out>/<subdir>/<name>``, stopped with SIGTERM once ``sz["budget_s"]`` is spent. Returns
    ``status``, ``t_start`` (epoch seconds just before the process started), ``wall_s``, ``cpu_s``
    (every process of the job that exited: ``getrusage(RUSAGE_CHILDREN)``; a local broker the bench
    started is not among them), the 1-minute load average before and after, ``run_dir`` and ``sets``."""
    sets = _job_sets(ctx, name, k, sz, subdir)
    args = ["-m", "rlstream", "run", str(sz["recipe"]), "--steps", str(sz["steps"]), "--no-live"]
    args += [x for s in sets for x in ("--set", s)]
    (ctx.out / subdir).mkdir(parents=True, exist_ok=True)
    load0, cpu0 = os.getloadavg()[0], cpu_children()
    t0 = time.time()
    with open(ctx.out / subdir / f"{name}.out", "w") as log:
        proc = subprocess.Popen([sys.executable, *args], env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        status = "budget spent"
        try:
            proc.wait(timeout=sz["budget_s"])
            status = "finished" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            pass
        finally:  # also when the bench itself is interrupted: the job never outlives it
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the launcher stops every role it started
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return {"status": status, "t_start": t0, "wall_s": round(time.time() - t0, 1),
            "cpu_s": round(cpu_children() - cpu0, 1), "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "run_dir": ctx.out / subdir / name, "sets": sets}  # fmt: skip


def job_config(job: dict):
    """The config a ``run_job`` job ran with, as its launcher wrote it: not resolved again here,
    where this process's RLSTREAM_* environment (which the roles never see: ``child_env``) would
    name other topics."""
    from rlstream.config import load_config

    return load_config(job["run_dir"] / "config.toml", [], environ={})


def prune(job: dict, cfg) -> None:
    """Remove what a summarised run no longer needs: the trainer's checkpoints and the published
    weights (gigabytes a run of a real model). Its steps log, eval metrics, logs and config stay.
    ``--keep-data`` keeps everything."""
    from consumers.trainer.state import TrainerCheckpoints

    run_dir = Path(job["run_dir"]).resolve()
    shutil.rmtree(TrainerCheckpoints(run_dir / "trainer").ckpts, ignore_errors=True)
    store = Path(cfg.store).resolve()
    if run_dir in store.parents:  # a local store of this run's own, not a shared or remote one
        shutil.rmtree(store, ignore_errors=True)


def run_one(ctx: BenchContext, name: str, k: int, sz: dict, seed: int | None = None) -> dict:
    """One job at staleness ``k`` for the size's budget (with ``seed``'s settings, ``seed_sets``,
    when one is given); its curve and counts. Its checkpoints and weights are then removed
    (``prune``) unless ``--keep-data``."""
    ctx.say(
        f"[bench] learn {name}: k = {k}" + ("" if seed is None else f", seed {seed}") + f", budget {sz['budget_s']} s"
    )
    if seed is not None:
        sz = {**sz, "sets": [*sz["sets"], *seed_sets(seed)]}
    job = run_job(ctx, name, k, sz)
    cfg = job_config(job)
    curve = eval_curve(cfg, job["run_dir"], job["t_start"])
    result = summarize(curve, steps_log(job["run_dir"]), sz["target_gain"])
    if not ctx.extra.get("keep_data"):
        prune(job, cfg)
    return {"name": name, "k": k, "seed": seed, "status": job["status"], "wall_s": job["wall_s"],
            "loadavg_at_start": job["loadavg"][0], "curve": curve, **result}  # fmt: skip


def steps_log(run_dir: Path) -> list[dict]:
    from consumers.trainer.state import read_steps_log

    return read_steps_log(run_dir / "trainer")


def version_points(steps: list[dict], t0: float) -> dict[int, tuple[float, int]]:
    """Version -> (seconds from ``t0`` to the end of the step that made it, samples trained up to
    it); version 0 at (0, 0). A steps-log entry's ``version`` is the one its step started from, so
    the step makes ``version + 1``."""
    at = {0: (0.0, 0)}
    samples = 0
    for s in steps:
        samples += len(s.get("used", []))
        at[int(s["version"]) + 1] = (s["time"] - t0, samples)
    return at


def eval_curve(cfg, run_dir: Path, t0: float) -> list[dict]:
    """``[{version, pass_at_1, reward_mean, wall_s, samples}]`` (and ``response_tokens``,
    ``truncated`` where the eval reports them): each evaluated version at the time its trainer step
    ended (version 0 at 0 s), with the samples trained up to it."""
    at = version_points(steps_log(run_dir), t0)
    out = {}
    for ev in metric_events(cfg):
        if ev["role"] != "eval" or "eval_pass_at_1" not in ev["metrics"] or ev["version"] not in at:
            continue
        wall, n = at[ev["version"]]
        out[ev["version"]] = {"version": ev["version"], "pass_at_1": rnd(ev["metrics"]["eval_pass_at_1"]),
                              "reward_mean": rnd(ev["metrics"].get("eval_reward_mean", 0.0)),
                              "wall_s": round(wall, 1), "samples": n}  # fmt: skip
        for key, name in (("eval_response_tokens_mean", "response_tokens"), ("eval_truncated_fraction", "truncated")):
            if key in ev["metrics"]:  # the eval's answer length: where a length-biased rule shows
                out[ev["version"]][name] = rnd(ev["metrics"][key])
    return [out[v] for v in sorted(out)]


def summarize(curve: list[dict], steps: list[dict], target_gain: float) -> dict:
    """Start, final and best pass@1; time and samples to ``start + target_gain``; steps, samples, stale."""
    base = curve[0]["pass_at_1"] if curve and curve[0]["version"] == 0 else None
    hit = next((c for c in curve if base is not None and c["pass_at_1"] >= base + target_gain - 1e-9), None)
    return {
        "pass_at_1_v0": base,
        "pass_at_1_final": curve[-1]["pass_at_1"] if curve else None,
        "final_version": curve[-1]["version"] if curve else None,
        "pass_at_1_best": max((c["pass_at_1"] for c in curve), default=None),
        "target": None if base is None else rnd(base + target_gain),
        "time_to_target_s": hit["wall_s"] if hit else None,
        "samples_to_target": hit["samples"] if hit else None,
        "steps": len(steps),
        "samples_trained": sum(len(s.get("used", [])) for s in steps),
        "stale_dropped": sum(len(s.get("stale", [])) for s in steps),
        "mean_step_s": rnd(sum(s.get("step_time_s", 0.0) for s in steps) / len(steps)) if steps else None,
        "logp_diff_fresh": _fresh_logp_diff(steps),
    }


def _fresh_logp_diff(steps: list[dict]) -> float | None:
    """Mean |trainer - engine| logprob per token over the steps that trained only version-lag-0
    samples: the engine/trainer mismatch alone (the policy had not moved)."""
    fresh = [s["logp_diff"] for s in steps if "logp_diff" in s and set(s.get("staleness", {})) <= {"0"}]
    return rnd(sum(fresh) / len(fresh), 4) if fresh else None


def ks_of(extra: dict, sz: dict) -> list[int]:
    """``--ks``: the staleness bounds to run (default: the size's)."""
    ks = [int(k) for k in extra.get("ks") or sz["ks"]]
    if any(k < 0 for k in ks):
        raise ValueError(f"bench learn --ks: staleness bounds are >= 0, got {ks}")
    return ks


def run_key(r: dict) -> tuple:
    """A learn run's place in the plan: ``(seed, repeat, k)``."""
    return (r["seed"], r.get("repeat", 0), r["k"])


def completed(r: dict) -> bool:
    """A run that ended as planned (its budget spent, or its steps done), not one that failed."""
    return not str(r["status"]).startswith("exit")


def run(ctx: BenchContext) -> dict:
    sz = {**SIZES[ctx.size], **({"budget_s": ctx.extra["budget_s"]} if ctx.extra.get("budget_s") else {})}
    ks = ks_of(ctx.extra, sz)
    seeds = list(ctx.extra.get("seeds") or [None])  # None: the recipe's own seeds
    path = ctx.out / "learn.json"
    plan = schedule(ks, seeds, sz["repeats"])
    runs, todo = resume(path, plan, run_key, completed, ctx.say)
    for seed, r, k in todo:
        name = f"learn-{ctx.run_id}-k{k}" + ("" if seed is None else f"-s{seed}") + f"-r{r}"
        runs.append({**run_one(ctx, name, k, sz, seed), "repeat": r})
        write_json(path, {"benchmark": "learn", "runs": runs})
    mine, others = in_plan(runs, plan, run_key)
    result = {"benchmark": "learn", "size": ctx.size, "recipe": str(sz["recipe"].relative_to(REPO)),
              "budget_s": sz["budget_s"], "target_gain": sz["target_gain"], "seeds": seeds, "runs": mine,
              "other_runs": others}  # fmt: skip
    result["by_k"] = by_k(mine)
    result["plots"] = [str(p) for p in plot(ctx.out, result)]
    write_json(path, result)
    return result


def at_time(curve: list[dict], seconds: float) -> float | None:
    """pass@1 of the last version evaluated within ``seconds`` of the run's clock."""
    seen = [c for c in curve if c["wall_s"] <= seconds]
    return seen[-1]["pass_at_1"] if seen else None


def over_seeds(runs: list[dict], arm_of, budget_s: float | None = None) -> dict:
    """Per arm (``arm_of(run)``) over its runs (seeds): time and samples to the target (a run that
    never reached it counts as not reached and is left out of the mean), held-out pass@1 at equal
    samples (the most samples every run has an evaluated version for) and, with ``budget_s``, at
    that time; samples per CPU-second where the runs have it. Means with 95 % intervals."""
    common = min((max((c["samples"] for c in r["curve"]), default=0) for r in runs), default=0)
    out = {"common_samples": common, "budget_s": budget_s, "arms": {}}
    for arm in dict.fromkeys(arm_of(r) for r in runs):
        mine = [r for r in runs if arm_of(r) == arm]
        hit = [r for r in mine if r["time_to_target_s"] is not None]
        at = [p for p in (at_samples(r["curve"], common) for r in mine) if p is not None]
        row = out["arms"][arm] = {
            "n": len(mine),
            "never_reached": len(mine) - len(hit),
            "time_to_target_s": mean_ci([r["time_to_target_s"] for r in hit]),
            "samples_to_target": mean_ci([r["samples_to_target"] for r in hit]),
            "pass_at_1_at_common": mean_ci(at),
            "pass_at_1_best": mean_ci([r["pass_at_1_best"] for r in mine if r["pass_at_1_best"] is not None]),
        }
        if budget_s:
            timed = (at_time(r["curve"], budget_s) for r in mine)
            row["pass_at_1_at_budget"] = mean_ci([p for p in timed if p is not None])
        rates = [r["samples_per_cpu_s"] for r in mine if r.get("samples_per_cpu_s") is not None]
        if rates:
            row["samples_per_cpu_s"] = mean_ci(rates)
    return out


def by_k(runs: list[dict]) -> dict:
    """``over_seeds`` per staleness bound k."""
    return over_seeds(runs, lambda r: str(r["k"]))


def table(result: dict) -> str:
    seeded = any(r.get("seed") is not None for r in result["runs"])
    runs = md_table(
        ["k", *(["seed"] if seeded else []), "status", "steps", "samples", "stale dropped", "step s (mean)",
         "pass@1 v0", "final (version)", "best", f"time to v0 + {result['target_gain']:g}", "samples to it",
         "mean abs logprob diff (lag 0)", "load avg at start"],
        [[r["k"], *([r.get("seed")] if seeded else []), r["status"], r["steps"], r["samples_trained"],
          r["stale_dropped"], r["mean_step_s"], r["pass_at_1_v0"], f"{r['pass_at_1_final']} (v{r['final_version']})",
          r["pass_at_1_best"], "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s",
          "-" if r["samples_to_target"] is None else r["samples_to_target"], r.get("logp_diff_fresh"),
          r["loadavg_at_start"]]
         for r in result["runs"]],
    )  # fmt: skip
    agg = result.get("by_k")
    if not agg or not any(s["n"] > 1 for s in agg["arms"].values()):
        return runs
    return f"{runs}\n\n{arms_table(agg, result['target_gain'], 'k')}"


EMPTY = mean_ci([])


def _ci(c: dict, fmt: str, top: float | None = None) -> str:
    """``mean [lo, hi]``, the interval cut to what the figure can be (at least 0; at most ``top``):
    with few seeds a t-interval reaches past it."""
    if c["mean"] is None:
        return "-"
    if c["lo"] is None:
        return format(c["mean"], fmt)
    hi = c["hi"] if top is None else min(top, c["hi"])
    return f"{c['mean']:{fmt}} [{max(0.0, c['lo']):{fmt}}, {hi:{fmt}}]"


def arms_table(agg: dict, target_gain: float, arm: str) -> str:
    """``over_seeds``'s summary as a table, one row per arm (its column named ``arm``)."""
    timed = [f"pass@1 at {agg['budget_s']:.0f} s"] if agg.get("budget_s") else []
    rated = any("samples_per_cpu_s" in s for s in agg["arms"].values())
    return md_table(
        [arm, "runs", f"time to v0 + {target_gain:g} (s)", "samples to it", "never reached",
         f"pass@1 at {agg['common_samples']} samples", *timed, "best pass@1", *(["samples / CPU-s"] if rated else [])],
        [[a, s["n"], _ci(s["time_to_target_s"], ".0f"), _ci(s["samples_to_target"], ".0f"), s["never_reached"],
          _ci(s["pass_at_1_at_common"], ".3f", 1), *([_ci(s["pass_at_1_at_budget"], ".3f", 1)] if timed else []),
          _ci(s["pass_at_1_best"], ".3f", 1), *([_ci(s.get("samples_per_cpu_s", EMPTY), ".2f")] if rated else [])]
         for a, s in agg["arms"].items()],
    )  # fmt: skip


def plot(out: Path, result: dict) -> list[Path]:
    def label(r: dict) -> str:
        seed = "" if r.get("seed") is None else f", seed {r['seed']}"
        return f"k = {r['k']}{seed}" + (f" ({r['name'].rsplit('-', 1)[-1]})" if result.get("repeats", 1) > 1 else "")

    return plot_curves(out / "learn.png", result["runs"], label, f"staleness against quality: {result['recipe']}")


def plot_curves(path: Path, runs: list[dict], label, title: str, fontsize: int | None = None) -> list[Path]:
    """Held-out pass@1 of each run against wall time and against samples trained."""
    if (plt := pyplot()) is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in runs:
        c = r["curve"]
        axes[0].plot([p["wall_s"] / 60 for p in c], [p["pass_at_1"] for p in c], marker="o", ms=3, label=label(r))
        axes[1].plot([p["samples"] for p in c], [p["pass_at_1"] for p in c], marker="o", ms=3, label=label(r))
    axes[0].set_xlabel("wall time (minutes)")
    axes[1].set_xlabel("samples trained")
    for ax in axes:
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=fontsize)
    fig.suptitle(title)
    return save_figure(fig, path)
