"""``rlstream bench trace``: where a k = 0 step of examples/next-digit.toml goes (the
framework tax). At k = 0 nothing overlaps: every step waits for the weights of the step before, so
the interval between two optimizer steps is the sum of the hops one group makes round the loop.
One ``rlstream run`` job (as a user starts it, ``rl.max_staleness = 0``), then, per step ``s`` from
the third on, from the records' own timestamps and the trainer's steps log:

* ``checkpoint``: step ``s-1`` ends -> its notice's ``created_at_ms`` (engine checkpoint and the
  weights file written; the notice is stamped after the weights);
* ``notice``: -> the notice's broker timestamp (signed and produced, acks=all);
* ``to generation``: -> the first ``gen_started_at_ms`` of the samples step ``s`` trains (a rollout
  worker reads rl.control, verifies and loads the weights, admits the group);
* ``generation``: -> the last ``gen_finished_at_ms`` of them;
* ``to rl.rollouts``: -> the last of their rl.rollouts broker timestamps (produced);
* ``reward``: -> the last ``scored_at_ms`` (the reward worker's batch window, decode, score);
* ``to rl.scored``: -> the last of their rl.scored broker timestamps (produced in the transaction);
* ``to the trainer``: -> step ``s`` starts (its end less ``step_time_s``: the transaction's commit,
  the read_committed fetch, assembling the groups);
* ``optimizer``: step ``s``'s ``step_time_s``.

The hops of one step add up to its interval (clocks of one host). Medians and p90 over the steps;
it prints figures and asserts nothing.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rlstream.dev.bench import learn
from rlstream.dev.bench.harness import BenchContext, md_table, percentile, read_topic, rnd

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "examples" / "next-digit.toml"
SIZES = {"tiny": {"steps": 12, "budget_s": 300}, "full": {"steps": 60, "budget_s": 900}}
HOPS = ("checkpoint", "notice", "to generation", "generation", "to rl.rollouts", "reward", "to rl.scored",
        "to the trainer", "optimizer")  # fmt: skip


def hops(steps: list[dict], notices: dict[int, tuple[int, dict]], rollouts: dict, scored: dict) -> list[dict]:
    """Per step (from the third): each hop in ms, and the interval from the step before. ``notices``:
    version -> (broker ts, WeightUpdate); ``rollouts``/``scored``: trajectory id -> (broker ts, record)."""
    out = []
    by_step = {s["step"]: s for s in steps}
    for s in steps:
        prev = by_step.get(s["step"] - 1)
        made = prev["version"] + 1 if prev else None  # an entry's version is the one its step started from
        if s["step"] < 3 or prev is None or made not in notices or not s.get("used"):
            continue
        ids = [t for t in s["used"] if t in rollouts and t in scored]
        if len(ids) < len(s["used"]):
            continue  # a sample not read back (cannot happen in a finished run): skip the step
        note_ts, note = notices[made]
        trajs = [rollouts[t][1] for t in ids]
        marks = [
            prev["time"] * 1000,
            note["created_at_ms"],
            note_ts,
            min(t["gen_started_at_ms"] for t in trajs),
            max(t["gen_finished_at_ms"] for t in trajs),
            max(rollouts[t][0] for t in ids),
            max(scored[t][1]["scored_at_ms"] for t in ids),
            max(scored[t][0] for t in ids),
            (s["time"] - s["step_time_s"]) * 1000,
            s["time"] * 1000,
        ]
        row = {h: b - a for h, a, b in zip(HOPS, marks[:-1], marks[1:], strict=True)}
        out.append({"step": s["step"], "interval_ms": (s["time"] - prev["time"]) * 1000, **row})
    return out


def read_run(cfg, run_dir: Path) -> list[dict]:
    notices = {r["version"]: (ts, r) for ts, _, _, r in read_topic(cfg, "control", "WeightUpdate")}
    rollouts = {r["trajectory_id"]: (ts, r) for ts, _, _, r in read_topic(cfg, "rollouts", "Trajectory")}
    scored = {
        r["trajectory"]["trajectory_id"]: (ts, r) for ts, _, _, r in read_topic(cfg, "scored", "ScoredTrajectory")
    }
    return hops(learn.steps_log(run_dir), notices, rollouts, scored)


def summarize(rows: list[dict]) -> dict:
    keys = ("interval_ms", *HOPS)
    return {
        k: {"p50": rnd(statistics.median(v), 1), "p90": rnd(percentile(v, 90), 1)}
        for k in keys
        if (v := [r[k] for r in rows])
    }


def run(ctx: BenchContext) -> dict:
    sz = {**SIZES[ctx.size], "recipe": RECIPE, "sets": [], "sync_threads": False}
    name = f"trace-{ctx.run_id}"
    ctx.say(f"[bench] trace {name}: rlstream run {RECIPE.name} at k = 0, {sz['steps']} steps")
    job = learn.run_job(ctx, name, 0, sz, subdir="trace")
    rows = read_run(learn.job_config(job), job["run_dir"])
    result = {"benchmark": "trace", "size": ctx.size, "status": job["status"], "steps": sz["steps"],
              "loadavg": job["loadavg"], "rows": rows, "summary": summarize(rows)}  # fmt: skip
    for k, v in result["summary"].items():
        ctx.say(f"[bench] trace {k}: p50 {v['p50']} ms, p90 {v['p90']} ms")
    return result


def table(result: dict) -> str:
    s = result["summary"]
    rows = [[k, s[k]["p50"], s[k]["p90"]] for k in ("interval_ms", *HOPS) if k in s]
    total = sum(s[h]["p50"] for h in HOPS if h in s)
    return (
        md_table(["hop of a k = 0 step (ms)", "p50", "p90"], rows)
        + f"\n\n{len(result['rows'])} steps traced ({result['status']}); the hops' medians add to {total:.0f} ms, "
        f"load {' / '.join(f'{x:g}' for x in result['loadavg'])} (before / after)."
    )
