"""``rlstream bench peer``: examples/next-digit.toml in Hugging Face TRL's ``GRPOTrainer`` and in
rlstream at k = 0, 1, 2 (``rl.max_staleness``), interleaved (TRL, k = 0, k = 1, k = 2, TRL, ...)
``repeats`` times on the same machine.

Matched: the same tiny random-init Llama (built in code by ``pipeline.models.materialize``: one
directory both load; the TRL process reports the digest of the weights it started from beside the
digest of that directory as rlstream's loader reads it), the same ten prompts, the same reward
(``reward.tasks`` through the project's ``TaskRouter``), 8 samples per prompt x 8 prompts = 64 samples
per optimizer step, one optimizer step per batch, the job's learning rate, AdamW settings, gradient
clipping, max new tokens and temperature (``rlstream.dev.bench.trl_grpo`` has the mapping and the
differences that remain: TRL is synchronous, in one process, with no Kafka). Threads: each as a
user would start it: TRL with every core (torch's default), rlstream with the launcher's setting (one
per role process) at every k; ``--size full`` adds TRL at one thread (``trl 1 thread``, after TRL in
each repeat), like for like with one rlstream role.

Each run is measured from its process start, so start-up (imports, model build, consumer groups
forming, the first weights) counts: rlstream runs as ``rlstream run`` does, roles started together,
not waiting for groups to settle; it uses the bench's broker (already running, as a user's cluster
would be: the broker's start is not in the figure, its CPU is). Per run:

* ``time_to_steps_s``: wall seconds from process start to the end of optimizer step ``steps``;
* ``time_to_reward_s``: to the first step at which the rolling mean of the per-step training reward
  (the mean over the step's 64 samples) over the last ``window`` steps reaches ``reward_target``;
* ``samples_per_cpu_s``: samples trained / CPU seconds of every process of the run
  (``getrusage(RUSAGE_CHILDREN)``, plus the bench broker's CPU during rlstream runs);
* ``longest_pause_s``: the longest gap between consecutive optimizer steps after the first (from
  the trainer's steps log, or TRL's per-step callback); for rlstream also per stage from the run's
  report.json (``trainer``; ``reward``: between two commits of one reward worker; ``rollout``:
  between two trajectories of one rollout worker);
* the 1-minute load average before and after.

The cold arm (``run_cold``) runs as a user does: a new local broker, a fresh ``rlstream run``.
It also says where its time goes (``cold_trace``): CPU seconds per process of the run and the
broker's requests per step by type.

``--size full`` also runs the recipe at k = 2 with one rollout and one reward worker (``1+1
workers``, after k = 2 in each repeat): the job sized to a 2-core machine.

Medians per arm, and the ratio to TRL of the best rlstream arm and of the recipe as shipped (its
best k). It prints figures and asserts nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.ports import free_port
from rlstream.config import BROKER_JVM_OPTIONS
from rlstream.dev.bench import cold_trace, learn
from rlstream.dev.bench.harness import (
    REPO,
    BenchContext,
    cpu_children,
    cpu_seconds,
    cpu_since,
    md_table,
    pyplot,
    rnd,
    save_figure,
    write_json,
)
from rlstream.dev.bench.trl_grpo import require_trl, run_child

RECIPE = REPO / "examples" / "next-digit.toml"
ONE_EACH = ["job.rollout_workers=1", "job.reward_workers=1"]
"""The ``1+1 workers`` arm (``--size full``): the recipe with one rollout and one reward worker, at
k = 2. On a 2-core machine the recipe's two of each spend CPU the cores do not have (five role
processes and a broker); the arm says what a user who sizes the job to the machine gets. The
ratio over TRL is printed for the best arm, and for the recipe as shipped."""
COLD_K = 2
"""The cold arm's staleness: the recipe's best k on two cores (the arms at a warm broker)."""
COLD = f"rlstream k={COLD_K}, cold broker"
"""The arm run as a user runs it (``run_cold``): its figures are the ones the README quotes."""
SIZES = {
    "tiny": {"steps": 20, "repeats": 1, "ks": [0, 1, 2], "budget_s": 240, "cold": True},
    "full": {
        "steps": 150,
        "repeats": 5,
        "cold": True,
        "ks": [0, 1, 2],
        "budget_s": 900,
        "trl_one_thread": True,
        "layouts": {"k2w1": (2, ONE_EACH)},
    },
}
REWARD_TARGET, WINDOW = 0.8, 5


def _sz(ctx: BenchContext) -> dict:
    return {**SIZES[ctx.size], **({"budget_s": ctx.extra["budget_s"]} if ctx.extra.get("budget_s") else {})}


def _sets(ctx: BenchContext, name: str) -> list[str]:
    return [*ctx.base_sets, f"job.name={name}", f"run_dir={json.dumps(str(ctx.out / 'peer'))}"]


def trl_spec(ctx: BenchContext, name: str, sz: dict, threads: int | None = None) -> dict:
    """The TRL run's settings, from next-digit's resolved config; torch's threads: every core
    unless ``threads``."""
    from pipeline.models import materialize, resolve_dtype
    from rlstream.job import resolve

    cfg = resolve(RECIPE, _sets(ctx, name), bootstrap="unused:1")
    t, o = cfg.trainer, cfg.trainer.optim
    return {
        "model_dir": str(materialize(cfg.model)), "train": str(cfg.feed.source), "eval": None,
        "reward": cfg.reward.model_dump(mode="json"), "group_size": cfg.rl.group_size,
        "groups_per_step": cfg.rl.groups_per_step, "lr": t.lr, "warmup_steps": o.warmup_steps,
        "grad_clip": o.grad_clip, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
        "bf16": resolve_dtype(getattr(t.engine, "dtype", "float32"), "cpu") == "bfloat16",
        "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature, "seed": t.seed,
        "max_steps": sz["steps"], "budget_s": None, "threads": threads or os.cpu_count() or 1, "check_weights": True,
        "out": str(ctx.out / "peer" / name / "trl.json"), "work_dir": str(ctx.out / "peer" / name),
    }  # fmt: skip


def figures(step_log: list[dict], t_start: float, steps: int) -> dict:
    """Time to ``steps``, to the reward target, first step and longest pause, from ``[{step, time,
    reward_mean}]`` (epoch seconds; ``reward_mean`` None for a step that trained nothing)."""
    log = sorted(step_log, key=lambda s: s["step"])
    at = next((s["time"] - t_start for s in log if s["step"] >= steps), None)
    rewarded = [s for s in log if s.get("reward_mean") is not None]
    hit = next((b for a, b in zip(range(len(rewarded)), rewarded[WINDOW - 1 :], strict=False)
                if statistics.fmean(r["reward_mean"] for r in rewarded[a : a + WINDOW]) >= REWARD_TARGET), None)  # fmt: skip
    gap, before = 0.0, None
    for a, b in itertools.pairwise(log):
        if b["time"] - a["time"] > gap:
            gap, before = b["time"] - a["time"], b["step"]
    last = [s["reward_mean"] for s in rewarded[-WINDOW:]]
    return {
        "steps": log[-1]["step"] if log else 0,
        "time_to_steps_s": rnd(at, 1),
        "time_to_reward_s": rnd(hit["time"] - t_start, 1) if hit else None,
        "first_step_s": rnd(log[0]["time"] - t_start, 1) if log else None,
        "longest_pause_s": rnd(gap, 2) if before is not None else None,
        "pause_before_step": before,
        "reward_last": rnd(statistics.fmean(last), 3) if last else None,
        "curve": [[rnd(s["time"] - t_start, 2), rnd(s.get("reward_mean"), 3)] for s in log],
    }


def run_trl(ctx: BenchContext, name: str, sz: dict, threads: int | None = None) -> dict:
    """TRL with torch's default threads (every core), or ``threads`` (the ``trl 1 thread`` arm: one
    thread, as each rlstream role process runs, for a like-for-like CPU comparison)."""
    spec = trl_spec(ctx, name, sz, threads)
    ctx.say(f"[bench] peer {name}: TRL GRPOTrainer, {sz['steps']} steps, {spec['threads']} thread(s)")
    load0 = os.getloadavg()[0]
    got = run_child(spec, timeout_s=sz["budget_s"])
    samples = sum(s["samples"] for s in got.get("step_log", []))
    rc = got["returncode"]
    return {"arm": TRL_ONE if threads == 1 else "trl", "name": name, "status": "ok" if rc == 0 else f"exit {rc}", "wall_s": got["wall_s"],
            **figures(got.get("step_log", []), got["t_start"], sz["steps"]), "samples_trained": samples,
            "cpu_s": got["cpu_s"], "samples_per_cpu_s": rnd(samples / got["cpu_s"]) if got["cpu_s"] else None,
            "stage_pause_s": None, "weights": got.get("weights_digest"),
            "weights_rlstream_loader": got.get("weights_digest_rlstream_loader"),
            "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip


def run_rlstream(ctx: BenchContext, name: str, k: int, sz: dict, digest: str | None, sets: list[str] = ()) -> dict:
    """``rlstream run`` of the recipe at ``k``; ``sets`` (the ``1+1 workers`` arm) over it."""
    ctx.say(f"[bench] peer {name}: rlstream run, k = {k}, {sz['steps']} steps {' '.join(sets)}")
    b0 = cpu_seconds(ctx.broker_pid)
    # as ``rlstream run`` runs it: the launcher's thread settings at every k (bench learn gives k = 0
    # every core per process; on a loaded machine that made k = 0 3x slower here: docs/results/performance.md)
    job = learn.run_job(
        ctx, name, k, {"recipe": RECIPE, "sets": list(sets), "sync_threads": False, **sz}, subdir="peer"
    )
    broker = round(cpu_since(ctx.broker_pid, b0), 1)
    steps = learn.steps_log(job["run_dir"])
    log = [{"step": s["step"], "time": s["time"], "samples": len(s.get("used", [])),
            "reward_mean": s.get("reward_mean") if s.get("used") else None} for s in steps]  # fmt: skip
    samples = sum(s["samples"] for s in log)
    report = job["run_dir"] / "report.json"
    stage = json.loads(report.read_text()).get("longest_pause_s") if report.is_file() else None
    cpu = job["cpu_s"] + broker
    return {"arm": f"rlstream k={k}" + (", 1+1 workers" if sets else ""), "name": name, "status": job["status"], "wall_s": job["wall_s"],
            **figures(log, job["t_start"], sz["steps"]), "samples_trained": samples, "cpu_s": round(cpu, 1),
            "broker_cpu_s": broker, "samples_per_cpu_s": rnd(samples / cpu) if cpu else None,
            "stage_pause_s": stage, "weights": digest, "loadavg": job["loadavg"]}  # fmt: skip


def _rlstream(env: dict, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


def run_cold(ctx: BenchContext, name: str, sz: dict, digest: str | None) -> dict:
    """The recipe as a user runs it from a shell: ``rlstream broker start`` in a fresh
    ``RLSTREAM_HOME`` (a new broker: cold JVM, no topics, no groups, nothing from earlier arms), then
    ``rlstream run examples/next-digit.toml -s rl.max_staleness=2`` as a fresh process with the
    user's environment (no bench settings, no thread settings, its default run dir under a fresh
    working directory), timed from that process's start. The broker's start is not in the times
    (a user starts it once; ``broker_start_s`` says what it took); its CPU from the run's start to
    its end is in samples / CPU-s. The broker is stopped and its directory removed afterwards."""
    ctx.say(f"[bench] peer {name}: new local broker, then rlstream run, k = {COLD_K}, {sz['steps']} steps")
    home = Path(tempfile.mkdtemp(prefix="rlstream-cold-"))
    work = ctx.out / "peer" / name
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_") or k == "RLSTREAM_CACHE"}
    env["RLSTREAM_HOME"] = str(home)
    sampler, requests = None, {}
    status, load0, b0, cpu0, t_start, wall, pid, broker_s = (
        "broker did not start",
        os.getloadavg()[0],
        None,
        0.0,
        time.time(),
        0.0,
        None,
        None,
    )
    try:
        t = time.time()
        jmx = free_port("127.0.0.1")  # the broker's request counters (cold_trace)
        opts = json.dumps([*BROKER_JVM_OPTIONS, *cold_trace.jmx_options(jmx)])
        got = _rlstream(env, "broker", "start", "-s", f"broker.jvm_options={opts}", timeout_s=300)
        broker_s = round(time.time() - t, 1)
        if got.returncode == 0:
            state = json.loads(_rlstream(env, "broker", "status", timeout_s=60).stdout or "{}")
            pid = state.get("pid")
            b0, load0, cpu0 = cpu_seconds(pid), os.getloadavg()[0], cpu_children()
            args = ["run", str(RECIPE), "-s", f"rl.max_staleness={COLD_K}", "--steps", str(sz["steps"]), "--no-live"]
            t_start = time.time()
            with open(work / "run.out", "w") as out:
                proc = subprocess.Popen([sys.executable, "-m", "rlstream", *args], env=env, cwd=work, stdout=out,
                                        stderr=subprocess.STDOUT)  # fmt: skip
                sampler = cold_trace.ProcessCPU(proc.pid, {"broker": pid})
                try:
                    proc.wait(timeout=sz["budget_s"])
                    status = "finished" if proc.returncode == 0 else f"exit {proc.returncode}"
                except subprocess.TimeoutExpired:
                    status = "budget spent"
                finally:  # the job never outlives the bench
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                        try:
                            proc.wait(timeout=120)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
                    sampler.stop()
            wall = round(time.time() - t_start, 1)
            requests = cold_trace.broker_requests(jmx)
    finally:
        broker = round(cpu_since(pid, b0), 1)
        _rlstream(env, "broker", "stop", timeout_s=120)
        shutil.rmtree(home, ignore_errors=True)
    run_dir = next((d for d in (work / "runs").glob("*") if (d / "trainer").is_dir()), work / "runs" / "next-digit")
    steps = learn.steps_log(run_dir) if (run_dir / "trainer").is_dir() else []
    log = [{"step": s["step"], "time": s["time"], "samples": len(s.get("used", [])),
            "reward_mean": s.get("reward_mean") if s.get("used") else None} for s in steps]  # fmt: skip
    samples = sum(s["samples"] for s in log)
    report = run_dir / "report.json"
    stage = json.loads(report.read_text()).get("longest_pause_s") if report.is_file() else None
    cpu = round(cpu_children() - cpu0, 1) + broker if pid else 0.0
    return {"arm": COLD, "name": name, "status": status, "wall_s": wall, **figures(log, t_start, sz["steps"]),
            "samples_trained": samples, "cpu_s": round(cpu, 1), "broker_cpu_s": broker, "broker_start_s": broker_s,
            "samples_per_cpu_s": rnd(samples / cpu) if cpu else None, "stage_pause_s": stage, "weights": digest,
            "cpu_by_process": sampler.by_name(run_dir / "logs" / "events.jsonl") if sampler else {},
            "broker_requests": requests,
            "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip


def _weights(ctx: BenchContext) -> dict:
    """The model directory every arm loads, its files' fingerprint and its weights' digest."""
    from pipeline.checkpoint import model_fingerprint
    from pipeline.models import load_model, materialize
    from rlstream.dev.bench.trl_grpo import state_digest
    from rlstream.job import plan

    cfg, _ = plan(RECIPE, _sets(ctx, "peer-weights"), bootstrap="unused:1")
    path = materialize(cfg.model)
    return {
        "model_dir": str(path),
        "fingerprint": model_fingerprint(path)[:16],
        "digest": state_digest(load_model(path)),
    }


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return rnd(statistics.median(xs), 2) if xs else None


def medians(runs: list[dict]) -> list[dict]:
    out = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        out.append({"arm": arm, "runs": len(rs), "reached_steps": sum(r["time_to_steps_s"] is not None for r in rs),
                    "reached_reward": sum(r["time_to_reward_s"] is not None for r in rs),
                    **{k: _median([r[k] for r in rs]) for k in ("time_to_steps_s", "time_to_reward_s", "first_step_s",
                                                                "samples_per_cpu_s", "longest_pause_s", "wall_s")}})  # fmt: skip
    return out


def ratios(med: list[dict]) -> dict | None:
    """The best rlstream arm (shortest median time to ``steps``) over TRL, for each median."""
    trl = next((m for m in med if m["arm"] == "trl"), None)
    ours = [m for m in med if not m["arm"].startswith("trl") and m["time_to_steps_s"] is not None]
    if trl is None or not ours:
        return None
    best = min(ours, key=lambda m: m["time_to_steps_s"])
    keys = ("time_to_steps_s", "time_to_reward_s", "samples_per_cpu_s", "longest_pause_s")
    later = rnd(best["first_step_s"] - trl["first_step_s"], 1) if best["first_step_s"] and trl["first_step_s"] else None
    return {"arm": best["arm"], **{k: rnd(best[k] / trl[k], 2) if best[k] and trl[k] else None for k in keys},
            "first_step_later_s": later}  # fmt: skip


def preflight() -> None:
    require_trl("peer")


def run(ctx: BenchContext) -> dict:
    require_trl("peer")
    sz = _sz(ctx)
    weights = _weights(ctx)
    runs: list[dict] = []
    result = {"benchmark": "peer", "size": ctx.size, "recipe": str(RECIPE.relative_to(REPO)), "steps": sz["steps"],
              "repeats": sz["repeats"], "reward_target": REWARD_TARGET, "window": WINDOW, "weights": weights,
              "runs": runs}  # fmt: skip
    for r in range(sz["repeats"]):
        layouts = sz.get("layouts", {})
        cold = ["cold"] if sz.get("cold") else []
        for arm in ["trl", *(["trl1"] if sz.get("trl_one_thread") else []), *sz["ks"], *layouts, *cold]:
            name = f"peer-{ctx.run_id}-{arm if isinstance(arm, str) else f'k{arm}'}-r{r}"
            if arm == "cold":
                runs.append(run_cold(ctx, name, sz, weights["digest"]))
            elif arm in layouts:
                runs.append(run_rlstream(ctx, name, layouts[arm][0], sz, weights["digest"], layouts[arm][1]))
            elif isinstance(arm, str):
                runs.append(run_trl(ctx, name, sz, 1 if arm == "trl1" else None))
            else:
                runs.append(run_rlstream(ctx, name, arm, sz, weights["digest"]))
            ctx.say(f"[bench] peer {name}: " + ", ".join(f"{k} {runs[-1][k]}" for k in SHOWN))
            write_json(ctx.out / "peer.json", result)
    result["medians"] = medians(runs)
    result["ratio_best_over_trl"] = ratios(result["medians"])
    result["ratio_recipe_over_trl"] = ratios([m for m in result["medians"] if "workers" not in m["arm"]])
    result["ratio_cold_over_trl"] = ratios([m for m in result["medians"] if m["arm"] in ("trl", COLD)])
    result["plots"] = [str(p) for p in plot(ctx.out, result)]
    write_json(ctx.out / "peer.json", result)
    return result


TRL_ONE = "trl 1 thread"
"""The arm of TRL at one torch thread (``--size full``): the ratio stays over TRL at its default."""

SHOWN = ("status", "time_to_steps_s", "time_to_reward_s", "samples_per_cpu_s", "longest_pause_s", "loadavg")


def table(result: dict) -> str:
    n, tgt = result["steps"], f"reward {result['reward_target']:g} ({result['window']}-step mean)"

    def s(x):
        return "-" if x is None else f"{x:.1f} s"

    def x(v):
        return "-" if v is None else f"{v:g}x"

    def stage(p):
        return "-" if not p else ", ".join(f"{k} {p[k]} s" for k in ("trainer", "reward", "rollout") if k in p)

    runs = md_table(
        ["run", "arm", "status", f"time to step {n}", f"time to {tgt}", "first step", "samples / CPU-s",
         "longest pause (before step)", "per stage (report.json)", "reward, last 5 steps", "start weights",
         "load before / after"],
        [[r["name"].rsplit("-", 1)[-1], r["arm"], r["status"], s(r["time_to_steps_s"]), s(r["time_to_reward_s"]),
          s(r["first_step_s"]), r["samples_per_cpu_s"],
          "-" if r["longest_pause_s"] is None else f"{r['longest_pause_s']:.2f} s ({r['pause_before_step']})",
          stage(r["stage_pause_s"]), r["reward_last"], r["weights"], " / ".join(f"{x:g}" for x in r["loadavg"])]
         for r in result["runs"]],
    )  # fmt: skip
    med = md_table(
        ["arm (median)", "runs", f"time to step {n}", f"time to {tgt} (runs that reached it)", "first step",
         "samples / CPU-s", "longest pause", "process wall"],
        [[m["arm"], m["runs"], s(m["time_to_steps_s"]), f"{s(m['time_to_reward_s'])} ({m['reached_reward']})",
          s(m["first_step_s"]), m["samples_per_cpu_s"], s(m["longest_pause_s"]), s(m["wall_s"])]
         for m in result.get("medians", [])],
    )  # fmt: skip
    ratio = ""
    for key, what in (("ratio_cold_over_trl", "As a user runs it (a new broker, a fresh `rlstream run`)"),
                      ("ratio_best_over_trl", "Best rlstream arm"), ("ratio_recipe_over_trl", "The recipe as shipped")):  # fmt: skip
        r = result.get(key)
        if not r or (key == "ratio_recipe_over_trl" and r == result.get("ratio_best_over_trl")):
            continue
        ratio += (
            f"\n\n{what} over TRL (medians, {r['arm']}): time to step {n} {x(r['time_to_steps_s'])}, "
            f"time to reward {x(r['time_to_reward_s'])}, samples / CPU-s {x(r['samples_per_cpu_s'])}, "
            f"longest pause {x(r['longest_pause_s'])}, first step {r.get('first_step_later_s')} s after TRL's.")  # fmt: skip
    w = result["weights"]
    head = (f"Start weights: `{w['model_dir']}`, files {w['fingerprint']}, weights digest {w['digest']} "
            f"(each TRL run reports the digest of what it loaded).\n\n")  # fmt: skip
    trl_cpu = [r["cpu_s"] for r in result["runs"] if r["arm"] == "trl" and r.get("cpu_s")]
    where = cold_trace.table([r for r in result["runs"] if r["arm"] == COLD], n, _median(trl_cpu))
    return (
        head
        + runs
        + "\n\n"
        + med
        + ratio
        + (f"\n\nWhere the cold arm's CPU and broker requests go:\n\n{where}" if where else "")
    )


def plot(out: Path, result: dict) -> list[Path]:
    if (plt := pyplot()) is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {}
    for r in result["runs"]:
        c = colors.setdefault(r["arm"], f"C{len(colors)}")
        pts = [p for p in r["curve"] if p[1] is not None]
        roll = [statistics.fmean(q[1] for q in pts[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(pts))]
        label = r["arm"] if sum(x["arm"] == r["arm"] for x in result["runs"][: result["runs"].index(r)]) == 0 else None
        axes[0].plot([p[0] for p in pts], roll, color=c, alpha=0.8, lw=1.2, label=label)
    axes[0].axhline(result["reward_target"], color="grey", ls=":", lw=1)
    axes[0].set_xlabel("seconds from process start")
    axes[0].set_ylabel(f"training reward ({WINDOW}-step rolling mean)")
    axes[0].legend(loc="lower right")
    med = result.get("medians", [])
    xs = range(len(med))
    axes[1].bar(
        [x - 0.2 for x in xs], [m["time_to_steps_s"] or 0 for m in med], 0.4, label=f"to step {result['steps']}"
    )
    axes[1].bar([x + 0.2 for x in xs], [m["time_to_reward_s"] or 0 for m in med], 0.4,
                label=f"to reward {result['reward_target']:g}")  # fmt: skip
    axes[1].set_xticks(list(xs), [m["arm"] for m in med])
    axes[1].set_ylabel("seconds (median)")
    axes[1].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"TRL GRPOTrainer vs rlstream: {result['recipe']}")
    return save_figure(fig, out / "peer.png")
