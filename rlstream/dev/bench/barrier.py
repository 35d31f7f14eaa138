"""``rlstream bench barrier``: the rule past the group barrier against the default rule, on the real
model. The recipe of ``bench learn`` (examples/smollm2-chain-sum.toml at the full size) runs at
the same staleness with the default whole-group rule and with over-provisioned groups
(``rollout.overprovision``: each group drawn with extra samples, the first ``group_size`` to finish
trained), one after another in alternating order, each for a wall-clock budget; the held-out eval
curves are read back and compared at equal samples trained (the done-when of the performance
issue: within 2 points) and against wall time. Same seeds, data, model and hyper-parameters; only
the rule differs. It prints figures and asserts nothing.

Sizes: ``tiny`` (the tiny model's arithmetic job, about 90 s a run: a smoke test of the harness)
and ``full`` (the real-model recipe at k = 1, 20 minutes a run).
"""

from __future__ import annotations

from pathlib import Path

from rlstream.dev.bench import learn
from rlstream.dev.bench.harness import REPO, BenchContext, md_table, write_json

SIZES = {
    "tiny": {**learn.SIZES["tiny"], "k": 1, "rules": {"default": [], "overprovision 2": ["rollout.overprovision=2"]}},
    "full": {
        **learn.SIZES["full"],
        "k": 1,
        "budget_s": 1200,
        "rules": {"default": [], "overprovision 2": ["rollout.overprovision=2"]},
    },
}


def at_samples(curve: list[dict], samples: int) -> float | None:
    """pass@1 of the last evaluated version trained on at most ``samples`` samples."""
    seen = [c for c in curve if c["samples"] <= samples]
    return seen[-1]["pass_at_1"] if seen else None


def run(ctx: BenchContext) -> dict:
    sz = {**SIZES[ctx.size], **({"budget_s": ctx.extra["budget_s"]} if ctx.extra.get("budget_s") else {})}
    names = list(sz["rules"])
    runs = []
    for r in range(sz["repeats"]):
        for rule in names if r % 2 == 0 else list(reversed(names)):
            case = {**sz, "sets": [*sz["sets"], *sz["rules"][rule]]}
            tag = rule.replace(" ", "")
            row = learn.run_one(ctx, f"barrier-{ctx.run_id}-{tag}-r{r}", sz["k"], case)
            row["rule"] = rule
            runs.append(row)
            write_json(ctx.out / "barrier.json", {"benchmark": "barrier", "runs": runs})
    # equal samples: the versions both curves reached (every run evaluates every eval.every_versions)
    common = min((max((c["samples"] for c in r["curve"]), default=0) for r in runs), default=0)
    for row in runs:
        row["pass_at_1_at_common"] = at_samples(row["curve"], common)
        row["samples_common"] = common
    result = {"benchmark": "barrier", "size": ctx.size, "recipe": str(sz["recipe"].relative_to(REPO)),
              "k": sz["k"], "budget_s": sz["budget_s"], "target_gain": sz["target_gain"], "runs": runs}  # fmt: skip
    result["plots"] = [str(p) for p in plot(ctx.out, result)]
    write_json(ctx.out / "barrier.json", result)
    return result


def table(result: dict) -> str:
    return md_table(
        ["rule", "k", "status", "steps", "samples", "stale dropped", "step s (mean)", "pass@1 v0", "final (version)",
         "best", "pass@1 at equal samples", f"time to v0 + {result['target_gain']:g}", "samples to it",
         "load avg at start"],
        [[r["rule"], r["k"], r["status"], r["steps"], r["samples_trained"], r["stale_dropped"], r["mean_step_s"],
          r["pass_at_1_v0"], f"{r['pass_at_1_final']} (v{r['final_version']})", r["pass_at_1_best"],
          f"{r['pass_at_1_at_common']} ({r['samples_common']})",
          "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s",
          "-" if r["samples_to_target"] is None else r["samples_to_target"], r["loadavg_at_start"]]
         for r in result["runs"]],
    )  # fmt: skip


def plot(out: Path, result: dict) -> list[Path]:
    return learn.plot_curves(
        out / "barrier.png",
        result["runs"],
        lambda r: f"{r['rule']} ({r['name'].rsplit('-', 1)[-1]})",
        f"past the group barrier against the default rule: {result['recipe']}, k = {result['k']}",
        fontsize=8,
    )
