"""``rlstream bench staleness``: does training on stale samples learn as well as synchronous RL?
Quality is measured in samples trained, not in time, so the answer does not depend on the
machine or its load: each arm (a staleness ``k`` and a rule that trains stale samples) runs the
same tiny-model recipe once per seed, and the seeds' spread gives a 95 % confidence interval.

Arms (``--arms``, all by default): ``k=0`` (synchronous), ``k=2 default`` (the default loss and the
whole-group rule), ``k=2 decoupled`` (AReaL's decoupled PPO, ``trainer.loss.type = "decoupled_ppo"``),
``k=2 overprovision`` (groups drawn with 2 extra samples, the first ``group_size`` to finish
trained: ``rollout.overprovision = 2``) and ``k=4 decoupled``. Tasks (``--task``): ``next-digit``
(examples/next-digit.toml, ~25 s a run on 2 cores) and ``arithmetic`` (examples/arithmetic.toml,
~2 minutes a run). ``--seeds 20`` runs seeds 0-19; ``--seeds 3,7`` (more than one) those seeds. A
seed sets the data order, the sampling and the initial weights (``learn.seed_sets``); runs go
seed by seed, the arms' order alternating from seed to seed, so load drifts hit every arm alike.

Per run, from the trainer's steps log, each step placed at the samples trained by the policy that
generated its samples (its samples trained less the run's mean lag times its samples per step:
a stale arm's training reward is its policy's of that many versions earlier; ``policy_shift``): the samples trained until the rolling mean of the per-step
training reward over ``WINDOW`` steps first reaches the task's target (``samples to target``; a run
that never reaches it counts at its total, a lower bound, and the table says how many), the
mean training reward over the ``WINDOW`` steps ending at the task's ``equal_samples`` samples
(``reward at equal samples``), and the realized staleness (the mean version lag of the samples
trained). Per arm: the mean of each with a 95 % Student-t interval over the seeds, and the
difference to ``k=0`` with a Welch interval. An arm "learns as well" when its interval overlaps
``k=0``'s and its mean is within ``MARGIN`` of ``k=0``'s, for both figures.

Resumable: every finished run is appended to ``staleness.json`` in the run directory; the same
command with ``--out`` of that directory skips the (task, arm, seed) runs it holds and starts the
rest as new jobs (a run that was killed is started again from nothing, never resumed from its
checkpoint). It prints figures and asserts nothing: the verdict is in the table.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from rlstream.dev.bench import learn
from rlstream.dev.bench.harness import (
    REPO,
    BenchContext,
    in_plan,
    md_table,
    mean_ci,
    pyplot,
    resume,
    rnd,
    save_figure,
    schedule,
    t95,
    write_json,
)
from rlstream.dev.bench.learn import seed_sets

ARMS = {
    "k=0": (0, []),
    "k=2 default": (2, []),
    "k=2 decoupled": (2, ["trainer.loss.type=decoupled_ppo"]),
    "k=2 overprovision": (2, ["rollout.overprovision=2"]),
    "k=4 decoupled": (4, ["trainer.loss.type=decoupled_ppo"]),
}
"""Every arm, by the name the table uses: ``(rl.max_staleness, settings)``. The first is the baseline."""
BASELINE = "k=0"
TASKS = {
    "next-digit": {
        "recipe": REPO / "examples" / "next-digit.toml",
        "steps": 150,
        "target": 0.8,
        "equal_samples": 2560,  # 40 steps of 64: mid-curve, where the arms can differ
        "budget_s": 300,
    },
    "arithmetic": {
        "recipe": REPO / "examples" / "arithmetic.toml",
        "steps": 200,
        "target": 0.5,
        "equal_samples": 6400,  # 100 steps of 64
        "budget_s": 600,
        "sets": ["job.eval=false"],
    },
}
"""The recipes and their figures: ``steps`` per run, the training-reward ``target`` (rolling
``WINDOW``-step mean), the sample count of ``reward at equal samples``, each run's time limit."""
SIZES = {"tiny": {"seeds": 2, "steps": 30}, "full": {"seeds": 20}}
"""``tiny``: 2 seeds, 30 steps a run (a smoke test of the harness, not of learning); ``full``:
20 seeds at the task's steps."""
WINDOW = 5
"""Steps in the rolling mean of the training reward."""
MARGIN = {"samples_to_target": 0.10, "reward_at_equal_samples": 0.03}
"""How close "as well" is: samples to target within 10 % of k = 0's mean, reward at equal samples
within 0.03 of it (and the 95 % intervals overlap)."""
RESULTS = "staleness.json"


def seeds_of(extra: dict, size: str) -> list[int]:
    """``--seeds N`` (one number): seeds 0..N-1; a longer list: those seeds; none: the size's count."""
    given = list(extra.get("seeds") or [])
    if len(given) == 1:
        return list(range(given[0]))
    return given or list(range(SIZES[size]["seeds"]))


def arms_of(extra: dict) -> list[str]:
    names = list(extra.get("arms") or ARMS)
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise ValueError(f"bench staleness --arms: unknown {unknown}; the arms are {list(ARMS)}")
    return names


def task_of(extra: dict) -> str:
    task = extra.get("task") or "next-digit"
    if task not in TASKS:
        raise ValueError(f"bench staleness --task: unknown {task!r}; the tasks are {list(TASKS)}")
    return task


def run_one(ctx: BenchContext, task: str, arm: str, seed: int, sz: dict) -> dict:
    """One ``rlstream run`` of the task's recipe for ``arm`` and ``seed``; its per-step curve."""
    k, sets = ARMS[arm]
    name = f"staleness-{ctx.run_id}-{task}-{arm.replace('=', '').replace(' ', '-')}-s{seed}"
    case = {"recipe": sz["recipe"], "steps": sz["steps"], "budget_s": sz["budget_s"], "sync_threads": False,
            "sets": [*sz.get("sets", []), *seed_sets(seed), *sets, "job.metrics_port_base=0"]}  # fmt: skip
    job = learn.run_job(ctx, name, k, case, subdir="staleness")
    steps = learn.steps_log(job["run_dir"])
    cum, curve, lag_sum, lag_n = 0, [], 0, 0
    for s in steps:
        cum += len(s.get("used", []))
        curve.append([cum, rnd(s.get("reward_mean"), 4) if s.get("used") else None])
        for d, n in (s.get("staleness") or {}).items():
            lag_sum, lag_n = lag_sum + int(d) * n, lag_n + n
    if not ctx.extra.get("keep_data"):
        learn.prune(job, learn.job_config(job))
    return {"task": task, "arm": arm, "k": k, "seed": seed, "name": name, "status": job["status"],
            "wall_s": job["wall_s"], "loadavg": job["loadavg"], "steps": len(steps), "samples_trained": cum,
            "stale_dropped": sum(len(s.get("stale", [])) for s in steps),
            "mean_lag": rnd(lag_sum / lag_n) if lag_n else None, "curve": curve}  # fmt: skip


def figures(curve: list[list], target: float, equal_samples: int, shift: float = 0.0) -> dict:
    """Samples to the rolling-mean target (None: never reached) and the mean reward of the
    ``WINDOW`` steps ending at ``equal_samples`` (None: the run did not get there), each step
    placed at its samples trained less ``shift`` (``policy_shift``)."""
    pts = [(n - shift, r) for n, r in curve if r is not None]
    hit = next(
        (pts[i][0] for i in range(WINDOW - 1, len(pts)) if statistics.fmean(r for _, r in pts[i - WINDOW + 1 : i + 1]) >= target),
        None,
    )  # fmt: skip
    upto = [r for n, r in pts if n <= equal_samples]
    reached = any(n >= equal_samples for n, _ in pts)
    return {
        "samples_to_target": None if hit is None else rnd(hit, 1),
        "reward_at_equal_samples": rnd(statistics.fmean(upto[-WINDOW:]), 4) if reached and upto else None,
    }


def policy_shift(run: dict) -> float:
    """Samples by which a run's training reward lags its policy: a step's reward is that of
    samples generated ``mean_lag`` versions earlier, by a policy trained on about ``mean_lag`` steps'
    samples fewer. Placing each step there compares the arms' policies at equal samples trained
    (k = 0: no shift)."""
    curve = run["curve"]
    return (run.get("mean_lag") or 0.0) * curve[-1][0] / len(curve) if curve else 0.0


def welch(a: dict, b: dict) -> dict:
    """``a - b`` with Welch's 95 % interval (``a``, ``b``: ``mean_ci`` results)."""
    if a["mean"] is None or b["mean"] is None:
        return {"diff": None, "lo": None, "hi": None}
    d = a["mean"] - b["mean"]
    if a["se"] is None or b["se"] is None:
        return {"diff": d, "lo": None, "hi": None}
    va, vb = a["se"] ** 2, b["se"] ** 2
    if va + vb == 0:
        return {"diff": d, "lo": d, "hi": d}
    df = (va + vb) ** 2 / ((va**2 / (a["n"] - 1) if va else 0) + (vb**2 / (b["n"] - 1) if vb else 0))
    half = t95(df) * math.sqrt(va + vb)
    return {"diff": d, "lo": d - half, "hi": d + half}


def as_well(arm: dict, base: dict, margin: float) -> bool | None:
    """Intervals overlap and the means are within ``margin``; None when either has no interval."""
    if arm["lo"] is None or base["lo"] is None:
        return None
    return arm["lo"] <= base["hi"] and base["lo"] <= arm["hi"] and abs(arm["mean"] - base["mean"]) <= margin


def summarize(runs: list[dict], arms: list[str], sz: dict) -> list[dict]:
    """Per arm: n, the two figures with intervals, the differences to the baseline, the verdicts."""
    out = []
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        figs = [figures(r["curve"], sz["target"], sz["equal_samples"], policy_shift(r)) for r in rs]
        logged = [figures(r["curve"], sz["target"], sz["equal_samples"])["reward_at_equal_samples"] for r in rs]
        row = {
            "arm": arm,
            "k": ARMS[arm][0],
            "runs": len(rs),
            "not_reached": sum(f["samples_to_target"] is None for f in figs),
        }
        # a run that never reached the target counts at its total samples: a lower bound, so an
        # arm that misses it often cannot look faster than it is
        for f, r in zip(figs, rs, strict=True):
            if f["samples_to_target"] is None and r["curve"]:
                f["samples_to_target"] = r["curve"][-1][0] - policy_shift(r)
        for key in MARGIN:
            row[key] = mean_ci([f[key] for f in figs if f[key] is not None])
        row["reward_as_logged"] = mean_ci([x for x in logged if x is not None])
        row["mean_lag"] = mean_ci([r["mean_lag"] for r in rs if r["mean_lag"] is not None])
        row["stale_dropped"] = sum(r["stale_dropped"] for r in rs)
        out.append(row)
    base = next((r for r in out if r["arm"] == BASELINE), None)
    for row in out:
        row["as_well"] = {}
        for key, margin in MARGIN.items():
            if base is None or row is base:
                row[f"{key}_diff"], row["as_well"][key] = None, None
                continue
            row[f"{key}_diff"] = welch(row[key], base[key])
            m = margin * base[key]["mean"] if key == "samples_to_target" and base[key]["mean"] else margin
            row["as_well"][key] = as_well(row[key], base[key], m)
    return out


def run_key(r: dict) -> tuple:
    """A run's place in the plan: ``(task, seed, arm)``."""
    return (r["task"], r["seed"], r["arm"])


def finished(r: dict) -> bool:
    return r["status"] == "finished"


def run(ctx: BenchContext) -> dict:
    task, arms, seeds = task_of(ctx.extra), arms_of(ctx.extra), seeds_of(ctx.extra, ctx.size)
    sz = {**TASKS[task], **{k: v for k, v in SIZES[ctx.size].items() if k != "seeds"}}
    if ctx.extra.get("budget_s"):
        sz["budget_s"] = ctx.extra["budget_s"]
    path = ctx.out / RESULTS
    plan = [(task, seed, arm) for seed, _, arm in schedule(arms, seeds)]
    runs, todo = resume(path, plan, run_key, finished, ctx.say)
    for i, (_, seed, arm) in enumerate(todo, 1):
        ctx.say(f"[bench] staleness {task} {arm} seed {seed} ({i}/{len(todo)}): starting")
        row = run_one(ctx, task, arm, seed, sz)
        runs.append(row)
        write_json(path, {"benchmark": "staleness", "runs": runs})
        f = figures(row["curve"], sz["target"], sz["equal_samples"])
        ctx.say(f"[bench] staleness {task} {arm} seed {seed}: {row['status']}, {row['steps']} steps, "
                f"samples to target {f['samples_to_target']}, reward at {sz['equal_samples']} "
                f"{f['reward_at_equal_samples']}, mean lag {row['mean_lag']}, {row['wall_s']} s, "
                f"load {row['loadavg'][0]}")  # fmt: skip
    mine = [r for r in in_plan(runs, plan, run_key)[0] if finished(r)]
    loads = [x for r in mine for x in r["loadavg"]]
    result = {"benchmark": "staleness", "size": ctx.size, "task": task, "recipe": str(sz["recipe"].relative_to(REPO)),
              "steps": sz["steps"], "target": sz["target"], "equal_samples": sz["equal_samples"], "window": WINDOW,
              "margin": MARGIN, "seeds": seeds, "arms": arms, "failed": len([r for r in runs if r["status"] != "finished"]),
              "load_during": [min(loads), max(loads), rnd(statistics.fmean(loads), 2)] if loads else None,
              "run_minutes": round(sum(r["wall_s"] for r in mine) / 60, 1),
              "summary": summarize(mine, arms, sz), "runs": runs}  # fmt: skip
    result["plots"] = [str(p) for p in plot(ctx.out, result, mine)]
    write_json(path, result)
    return result


def _ci(c: dict, nd: int = 3, scale: float = 1.0) -> str:
    if c["mean"] is None:
        return "-"
    if c["lo"] is None:
        return f"{c['mean'] * scale:.{nd}f}"
    return f"{c['mean'] * scale:.{nd}f} [{c['lo'] * scale:.{nd}f}, {c['hi'] * scale:.{nd}f}]"


def _diff(d: dict | None, nd: int) -> str:
    if not d or d["diff"] is None:
        return "-"
    return f"{d['diff']:+.{nd}f}" + ("" if d["lo"] is None else f" [{d['lo']:+.{nd}f}, {d['hi']:+.{nd}f}]")


def _verdict(v: bool | None) -> str:
    return {True: "yes", False: "no", None: "-"}[v]


def table(result: dict) -> str:
    m = result["margin"]
    head = (
        f"Task `{result['recipe']}`, {result['steps']} steps a run, seeds {_seed_span(result['seeds'])}, "
        f"arms {', '.join(result['arms'])}. Samples to target: samples trained until the {result['window']}-step "
        f"rolling mean of the training reward first reaches {result['target']:g} (a run that never does counts at "
        f"its total samples). Reward at equal samples: the "
        f"mean training reward of the {result['window']} steps ending at {result['equal_samples']} samples. "
        f"Both place a step's training reward at the samples trained by the policy that generated it: "
        f"its samples trained less the run's mean lag times its samples per step (a stale arm's reward "
        f"is its policy's of mean-lag versions earlier); the as-logged reward is without that shift. "
        f"Means with 95 % Student-t intervals over the seeds; differences to k=0 with Welch intervals. "
        f'"As well": the intervals overlap and the mean is within {m["samples_to_target"]:.0%} of k=0\'s '
        f"samples to target / {m['reward_at_equal_samples']:g} of its reward. Load (1-minute) during the runs: "
        f"{_load(result['load_during'])}; "
        f"runs that did not finish (excluded): {result['failed']}; {result.get('run_minutes', 0):g} minutes of "
        f"run time in all."
    )
    rows = [
        [r["arm"], r["runs"], _ci(r["samples_to_target"], 0), r["not_reached"], _diff(r["samples_to_target_diff"], 0),
         _verdict(r["as_well"].get("samples_to_target")), _ci(r["reward_at_equal_samples"]),
         _diff(r["reward_at_equal_samples_diff"], 3), _verdict(r["as_well"].get("reward_at_equal_samples")),
         _ci(r.get("reward_as_logged") or {"mean": None}), _ci(r["mean_lag"], 2), r["stale_dropped"]]
        for r in result["summary"]
    ]  # fmt: skip
    return head + "\n\n" + md_table(
        ["arm", "n", "samples to target", "never reached", "vs k=0", "as well", "reward at equal samples",
         "vs k=0", "as well", "reward at equal samples, as logged", "mean lag (versions)", "stale dropped"], rows)  # fmt: skip


def _load(load: list[float] | None) -> str:
    """``min to max (mean m)`` of the 1-minute load averages at each run's start and end."""
    return "-" if not load else f"{load[0]:g} to {load[1]:g} (mean {load[2]:g}, at each run's start and end)"


def _seed_span(seeds: list[int]) -> str:
    return (
        f"{seeds[0]}-{seeds[-1]}"
        if seeds == list(range(seeds[0], seeds[0] + len(seeds)))
        else ", ".join(map(str, seeds))
    )


def plot(out: Path, result: dict, runs: list[dict]) -> list[Path]:
    """Left: the training-reward curve per arm (the mean over the seeds step by step; each seed
    faint) against the samples trained by the policy that generated it (``policy_shift``);
    right: samples to target per arm, every seed and the mean with its interval."""
    if (plt := pyplot()) is None or not runs:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(result["arms"]):
        rs = [r for r in runs if r["arm"] == arm]
        c = colors[i % len(colors)]
        by_step: dict[int, list[tuple[float, float]]] = {}
        for r in rs:
            shift = policy_shift(r)
            pts = [(n - shift, v) for n, v in r["curve"] if v is not None]
            axes[0].plot([n for n, _ in pts], [v for _, v in pts], color=c, alpha=0.06, lw=0.8)
            for j, p in enumerate(pts):
                by_step.setdefault(j, []).append(p)
        steps = [j for j in sorted(by_step) if len(by_step[j]) >= max(1, len(rs) // 2)]
        axes[0].plot([statistics.fmean(n for n, _ in by_step[j]) for j in steps],
                     [statistics.fmean(v for _, v in by_step[j]) for j in steps],
                     color=c, lw=1.6, label=f"{arm} (n={len(rs)})")  # fmt: skip
    axes[0].axhline(result["target"], color="grey", ls=":", lw=1)
    axes[0].axvline(result["equal_samples"], color="grey", ls="--", lw=1)
    axes[0].set_xlabel("samples trained by the generating policy")
    axes[0].set_ylabel("training reward (step mean)")
    axes[0].legend(fontsize=8, loc="lower right")
    for i, s in enumerate(result["summary"]):
        pts = [figures(r["curve"], result["target"], result["equal_samples"], policy_shift(r))["samples_to_target"]
               for r in runs if r["arm"] == s["arm"]]  # fmt: skip
        pts = [p for p in pts if p is not None]
        axes[1].scatter([i] * len(pts), pts, s=10, alpha=0.4, color=colors[i % len(colors)])
        c = s["samples_to_target"]
        if c["mean"] is not None:
            err = None if c["lo"] is None else [[c["mean"] - c["lo"]], [c["hi"] - c["mean"]]]
            axes[1].errorbar([i + 0.15], [c["mean"]], yerr=err, fmt="o", color="black", capsize=4)
    axes[1].set_xticks(range(len(result["summary"])), [s["arm"] for s in result["summary"]], rotation=20, fontsize=8)
    axes[1].set_ylabel(f"samples to reward {result['target']:g}")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"staleness against quality: {result['recipe']}, mean and 95 % interval over seeds", fontsize=10)
    return save_figure(fig, out / f"staleness-{result['task']}.png")
