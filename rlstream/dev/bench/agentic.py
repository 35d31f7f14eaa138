"""Benchmark: agentic (multi-turn) RL with slow tools. The same workers and the same total work
(``trainer.max_steps`` steps of G groups of n episodes) under two rollout modes and max staleness
k in {0, 1, 2}:

* ``env-async`` (the default worker): environment-level async; while one episode waits on its
  tool call, the engine goes on generating the others, and a slot that frees starts the next one.
* ``turn-sync`` (``rollout.env.turn_sync = true``, a baseline): a turn-synchronous batch framework;
  the tool calls of the ended turns run only when no sample is generating, and generation resumes
  only when every one of them has returned.

``turn-sync`` at k = 0 is what a synchronous framework does, and the speedups are over it
(``speedup vs sync``); the speedup over ``env-async`` at k = 0 is shown too.

The workload (chosen from what ROLL Flash describes for agentic tasks, before measuring): episodes
of ``turns`` model turns, each followed by a tool call of the sim environment
(``rlstream.dev.bench.agent_env``) whose latency is lognormal (median 0.4 s, sigma 0.8) clipped to
0.1-2 s, deterministic from the trajectory id and the turn. Model turns come from the ``sim``
rollout engine (continuous batching at ``token_latency_s`` per decode step, the long-tailed lengths
of benchmark 1's ``long-tail`` workload, at most ``max_turn_tokens`` a turn; a trajectory's turns
have the same length) and training from the ``sim`` train engine, whose cost per token is set so
training capacity equals generation capacity. The ideal-overlap bound is ``min(generation,
training capacity)`` from those configured rates, generation capacity being
``slots / (turns * (token_latency * mean turn tokens + mean tool latency))`` (a slot is held while
its episode waits on a tool call; ``rollout.env.workers`` equals the slots, so no call queues);
``ideal sync`` is the same rates alternating, ``1 / (1/generation + 1/training)``.

Everything else is the real pipeline (feed, rollout workers, reward, trainer with the staleness
gate, WeightUpdates). Figures over the steady-state window of ``async_sync.analyze``. It prints
figures; it asserts nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlstream.dev.bench.agent_env import DEFAULTS, OBSERVATION, mean_latency
from rlstream.dev.bench.async_sync import (
    PROMPT_TOKENS,
    analyze,
    common_sets,
    rollout_totals,
    sim_engine,
    write_prompts,
)
from rlstream.dev.bench.harness import (
    BenchContext,
    log_line,
    make_config,
    md_table,
    pyplot,
    rnd,
    run_pipeline,
    write_json,
)

ENV_SPEC = "rlstream.dev.bench.agent_env:SimToolEnv"
TASK = "bench"
MODES = ("turn-sync", "env-async")
SIZES = {
    "tiny": {  # the CI smoke test; tool latencies scaled down by 4 so it stays well under 2 min
        "steps": 3, "groups": 2, "n": 4, "workers": 1, "inflight": 8, "latency": 0.01, "median": 6, "clip": 16,
        "turns": 3, "runs": [["turn-sync", 0], ["env-async", 0], ["env-async", 1]],
        "env": {"median_s": 0.1, "min_s": 0.025, "max_s": 0.5},
    },
    "full": {
        "steps": 12, "groups": 4, "n": 8, "workers": 2, "inflight": 16, "latency": 0.02, "median": 12, "clip": 32,
        "turns": 4, "runs": [[mode, k] for k in (0, 1, 2) for mode in ("turn-sync", "env-async")], "env": {},
    },
}  # fmt: skip
STOP_S = 8.0
"""``liveness.shutdown_timeout_s`` of the runs: the harness waits 10 s after SIGTERM before it
SIGKILLs a role, so a worker's own stop bound must be shorter. With the default 30 s a rollout
worker spends up to 22 s finishing admitted episodes nobody will train (4 turns of tool calls of
up to 2 s each, longer turn-synchronously) and is killed; within 8 s it finishes what it can,
leaves the rest uncommitted and exits."""
WORKLOAD = "long-tail"
"""Turn lengths: benchmark 1's long-tail distribution (lognormal sigma 0.5, 3% at the clip)."""


def env_options(sz: dict) -> dict:
    return {**DEFAULTS, **sz["env"], "turns": sz["turns"]}


def plan(sz: dict, balance: float = 1.0) -> tuple[dict, dict]:
    """The sim engines' and environment's settings, and the bounds they imply."""
    from libs.engines.sim import expected_length

    eng = sim_engine(sz, WORKLOAD)
    turn = expected_length(eng, sz["clip"], 50_000)
    tool = mean_latency(env_options(sz))
    slots, turns = sz["workers"] * sz["inflight"], sz["turns"]
    episode_s = turns * (sz["latency"] * turn + tool)
    gen = slots / episode_s
    tokens = PROMPT_TOKENS + turns * (turn + len(OBSERVATION))
    token_cost = 1.0 / (gen * balance * tokens)
    train = 1.0 / (token_cost * tokens)
    sets = {
        "rollout.engine": {k: v for k, v in eng.model_dump().items() if v is not None},
        "rollout.max_new_tokens": turns * (sz["clip"] + len(OBSERVATION)),
        "rollout.env.tasks": {TASK: ENV_SPEC},
        "rollout.env.options": {TASK: env_options(sz)},
        "rollout.env.max_turns": turns,
        "rollout.env.max_turn_tokens": sz["clip"],
        "rollout.env.workers": sz["inflight"],
        "trainer.engine": {"type": "sim", "token_cost_s": token_cost},
        "trainer.micro_batch_size": sz["groups"] * sz["n"],
    }
    bounds = {
        "turns": turns,
        "mean_turn_tokens": round(turn, 2),
        "mean_tool_latency_s": round(tool, 3),
        "episode_slot_s": round(episode_s, 3),
        "generation_capacity_samples_per_s": round(gen, 2),
        "training_capacity_samples_per_s": round(train, 2),
        "ideal_samples_per_s": round(min(gen, train), 2),
        "ideal_sync_samples_per_s": round(1 / (1 / gen + 1 / train), 2),
        "token_latency_s": sz["latency"],
        "train_token_cost_s": token_cost,
        "decode_slots": slots,
    }
    return sets, bounds


def run_one(ctx: BenchContext, mode: str, k: int) -> dict:
    sz = SIZES[ctx.size]
    name = f"agentic-{mode}-k{k}"
    run_dir = ctx.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    source = write_prompts(run_dir / "prompts.jsonl", 64)
    sets, bounds = plan(sz)
    sets["rollout.env.turn_sync"] = mode == "turn-sync"
    sets["liveness.shutdown_timeout_s"] = STOP_S
    cfg, path = make_config(ctx, name, {**common_sets(sz, k, source), **sets})
    res = run_pipeline(ctx, cfg, path, sz["workers"], 1, timeout_s=900)
    row = {"mode": mode, "k": k, "status": res.status, "wall_s": res.wall_s, "loadavg": res.loadavg}
    row.update(analyze(cfg, Path(cfg.run_dir), sz["workers"], sz["inflight"]))
    row.update(rollout_totals(cfg, ("env.tool_calls", "dead_letters")))
    row["plan"] = bounds
    row["force_killed"] = force_killed(Path(cfg.run_dir))
    row["achieved_over_ideal"] = rnd((row.get("samples_per_s") or 0) / bounds["ideal_samples_per_s"])
    log_line(ctx, name, status=res.status, samples_per_s=row.get("samples_per_s"), stale=row.get("stale_dropped"),
             tool_calls=row.get("env.tool_calls"), wall_s=res.wall_s, force_killed=row["force_killed"])  # fmt: skip
    return row


def force_killed(run_dir: Path) -> list[str]:
    """The roles the supervisor had to SIGKILL at the end of a run (``stop_timeout`` events)."""
    path = run_dir / "logs" / "events.jsonl"
    if not path.is_file():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted({e["name"] for e in events if e.get("event") == "stop_timeout"})


def run(ctx: BenchContext) -> dict:
    sz = SIZES[ctx.size]
    rows = [run_one(ctx, mode, k) for mode, k in sz["runs"]]
    sync = next((r.get("samples_per_s") for r in rows if r["mode"] == "turn-sync" and r["k"] == 0), None)
    env0 = next((r.get("samples_per_s") for r in rows if r["mode"] == "env-async" and r["k"] == 0), None)
    for r in rows:
        r["speedup_over_sync"] = rnd((r.get("samples_per_s") or 0) / sync) if sync else None
        r["speedup_over_env_async_k0"] = rnd((r.get("samples_per_s") or 0) / env0) if env0 else None
    result = {"benchmark": "agentic", "size": ctx.size, "sizes": sz, "plan": plan(sz)[1], "runs": rows}
    write_json(ctx.out / "agentic.json", result)
    result["plots"] = [str(p) for p in plot(ctx.out, rows, result["plan"])]
    write_json(ctx.out / "agentic.json", result)
    return result


def table(result: dict) -> str:
    p = result["plan"]
    headers = ["rollout mode", "k", "samples/s", "wall s", "speedup vs sync", "vs env-async k=0", "trainer idle",
               "rollout idle", "stale dropped", "tool calls", "achieved/ideal", "force-killed"]  # fmt: skip
    rows = [
        [r["mode"], r["k"], r.get("samples_per_s"), r.get("wall_s"), r.get("speedup_over_sync"),
         r.get("speedup_over_env_async_k0"), r.get("trainer_idle_fraction"), r.get("rollout_idle_fraction"),
         r.get("stale_dropped"), r.get("env.tool_calls"), r.get("achieved_over_ideal"),
         ", ".join(r.get("force_killed") or []) or "none"]
        for r in result["runs"]
    ]  # fmt: skip
    sz = result["sizes"]
    note = (
        f"Workload: {sz['workers']} rollout workers x {sz['inflight']} slots, {sz['steps']} steps of "
        f"{sz['groups']} groups x {sz['n']} episodes; {p['turns']} turns per episode, mean turn "
        f"{p['mean_turn_tokens']} tokens at {p['token_latency_s']} s per decode step, tool calls of mean "
        f"{p['mean_tool_latency_s']} s (lognormal, clipped to 0.1-2 s at the full size). Configured rates: "
        f"generation {p['generation_capacity_samples_per_s']} samples/s, training "
        f"{p['training_capacity_samples_per_s']} samples/s; ideal overlap {p['ideal_samples_per_s']} samples/s, "
        f"ideal sync (the same rates alternating) {p['ideal_sync_samples_per_s']} samples/s. "
        "Sync = turn-sync at k = 0."
    )
    return md_table(headers, rows) + "\n\n" + note


def plot(out: Path, rows: list[dict], bounds: dict) -> list[Path]:
    if (plt := pyplot()) is None:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ks = sorted({r["k"] for r in rows})
    width = 0.38
    for j, (mode, color) in enumerate(zip(MODES, ("#dd8452", "#4c72b0"), strict=True)):
        rs = {r["k"]: r for r in rows if r["mode"] == mode}
        xs = [i + (j - 0.5) * width for i in range(len(ks))]
        ys = [rs[k].get("samples_per_s") or 0 if k in rs else 0 for k in ks]
        ax.bar(xs, ys, width, color=color, label=mode)
        for x, k in zip(xs, ks, strict=True):
            if k in rs and rs[k].get("speedup_over_sync"):
                ax.text(x, rs[k].get("samples_per_s") or 0, f"{rs[k]['speedup_over_sync']:.2f}x", ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
    ax.axhline(bounds["ideal_samples_per_s"], color="#c44e52", ls="--", lw=1.2,
               label=f"ideal overlap {bounds['ideal_samples_per_s']:.1f}/s")  # fmt: skip
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("max staleness k (0 = sync)")
    ax.set_ylabel("samples/s trained")
    ax.set_title("agentic sim: speedup over turn-sync k = 0", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "agentic-throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
