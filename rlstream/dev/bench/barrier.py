"""``rlstream bench barrier``: the rule past the group barrier against the default rule, on the real
model. The recipe of ``bench learn`` (examples/smollm2-chain-sum.toml at the full size) runs at
the same staleness with the default whole-group rule and with over-provisioned groups
(``rollout.overprovision``: each group drawn with extra samples, the first ``group_size`` to finish
trained), one after another in alternating order, each for a wall-clock budget; the held-out eval
curves are read back and compared at equal samples trained (the done-when of the performance
issue: within 2 points) and against wall time. Same seeds, data, model and hyper-parameters; only
the rule differs. It prints figures and asserts nothing.

Sizes: ``tiny`` (the tiny model's arithmetic job, about 90 s a run: a smoke test of the harness)
and ``full`` (the real-model recipe at k = 1, 20 minutes a run). ``--seeds 2,3`` runs the pair once
per seed (``feed.shuffle_seed``, ``rollout.engine.seed`` and ``trainer.seed`` set to it; the held-out
problems stay the same): one pair is one draw of a noisy curve (49 held-out problems, one problem = 2
points), so the comparison that means something is the paired difference, mode minus default at each
sample count both runs of a seed evaluated, averaged per seed and then over the seeds, with the
spread between the seeds.
"""

from __future__ import annotations

from pathlib import Path

from rlstream.dev.bench import learn
from rlstream.dev.bench.harness import REPO, BenchContext, md_table, schedule, write_json
from rlstream.dev.bench.learn import at_samples, seed_sets

RULES = {
    "default": [],
    "overprovision 2": ["rollout.overprovision=2"],
    # its steps train ~10 samples per group of 8 (the tail too), so it is evaluated every 8 versions
    # to land near the default's sample counts (every 10 versions of 32 samples)
    "overprovision 2 tail": ["rollout.overprovision=2", "rollout.overprovision_tail=train", "eval.every_versions=8"],
    "overprovision 1": ["rollout.overprovision=1"],
    # the same with 3 groups a step (~30 samples, the tail included): about as many samples per
    # optimizer step as the default's 4 groups of 8, so equal samples are also about equal steps
    "overprovision 2 tail G3": [
        "rollout.overprovision=2",
        "rollout.overprovision_tail=train",
        "rl.groups_per_step=3",
        "eval.every_versions=11",
    ],
    # the trained tail at the default's draws and step: groups of 8 draws close at a quorum of 6,
    # the other 2 are their tail; 4 groups a step, so where tails join their group before the
    # trainer takes it a step is the default's 4 groups of 8, and only late tails differ
    "quorum 6 of 8 tail": [
        "rl.group_size=6",
        "rollout.overprovision=2",
        "rollout.overprovision_tail=train",
    ],
    # not a rule: the default rule with another sampling stream (the same data order and initial
    # weights), to measure how far two runs of one rule land apart on this benchmark
    "default other draws": ["rollout.engine.seed=100{seed}"],
}
"""Every rule the bench knows, by the name its tables use; ``--rules`` picks some. ``{seed}`` in a
setting is the run's seed."""
SIZES = {
    "tiny": {**learn.SIZES["tiny"], "k": 1, "rules": ["default", "overprovision 2 tail"]},
    "full": {**learn.SIZES["full"], "k": 1, "budget_s": 1200, "rules": ["default", "overprovision 2 tail"]},
}
DEFAULT_SEEDS = [0]


def run_sets(rule: str, seed: int) -> list[str]:
    """The settings of one run of ``rule`` with ``seed`` (the rule's after the seed's, so a rule
    may set a seed of its own)."""
    return [*seed_sets(seed), *(s.format(seed=seed) for s in RULES[rule])]


def run(ctx: BenchContext) -> dict:
    sz = {**SIZES[ctx.size], **({"budget_s": ctx.extra["budget_s"]} if ctx.extra.get("budget_s") else {})}
    names = list(ctx.extra.get("rules") or sz["rules"])
    unknown = [r for r in names if r not in RULES]
    if unknown:
        raise ValueError(f"bench barrier --rules: unknown {unknown}; the rules are {list(RULES)}")
    seeds = list(ctx.extra.get("seeds") or DEFAULT_SEEDS)
    runs = earlier_runs(ctx.extra.get("against"), names, seeds)
    names = [*dict.fromkeys([*(r["rule"] for r in runs), *names])]
    if names[0] != "default" and "default" in names:  # the paired comparison is against the first
        names = ["default", *(n for n in names if n != "default")]
    pairs = [(seed, r) for seed in seeds for r in range(sz["repeats"])]
    mine = [n for n in names if not any(r["rule"] == n for r in runs)]
    for seed, r, rule in schedule(mine, seeds, sz["repeats"]):
        case = {**sz, "sets": [*sz["sets"], *run_sets(rule, seed)]}
        tag = rule.replace(" ", "")
        row = learn.run_one(ctx, f"barrier-{ctx.run_id}-{tag}-s{seed}-r{r}", sz["k"], case)
        row["rule"], row["seed"], row["repeat"] = rule, seed, r
        runs.append(row)
        write_json(ctx.out / "barrier.json", {"benchmark": "barrier", "runs": runs})
    # equal samples: the versions both curves of a pair reached (each run evaluates every
    # eval.every_versions)
    for seed, r in pairs:
        rows = [x for x in runs if (x["seed"], x["repeat"]) == (seed, r)]
        common = min((max((c["samples"] for c in x["curve"]), default=0) for x in rows), default=0)
        for row in rows:
            row["pass_at_1_at_common"] = at_samples(row["curve"], common)
            row["samples_common"] = common
    result = {"benchmark": "barrier", "size": ctx.size, "recipe": str(sz["recipe"].relative_to(REPO)),
              "k": sz["k"], "budget_s": sz["budget_s"], "target_gain": sz["target_gain"], "seeds": seeds,
              "runs": runs, "paired": paired(runs, names)}  # fmt: skip
    result["plots"] = [str(p) for p in plot(ctx.out, result)]
    write_json(ctx.out / "barrier.json", result)
    return result


def earlier_runs(path: str | None, names: list[str], seeds: list[int]) -> list[dict]:
    """``--against``: the runs of an earlier ``barrier.json`` of the given seeds and of rules other
    than ``names`` (those this invocation runs), each marked with the file it came from."""
    if not path:
        return []
    import json

    got = [
        {**r, "from": Path(path).name}
        for r in json.loads(Path(path).read_text())["runs"]
        if r["rule"] not in names and r.get("seed", 0) in seeds
    ]
    if not got:
        raise ValueError(f"bench barrier --against {path}: no run of another rule with seeds {seeds}")
    return got


EQUAL_SAMPLES_TOLERANCE = 0.05
"""Two evaluations count as at equal samples when their sample counts differ by at most this
fraction (a rule whose steps train more samples than the default's is evaluated at other counts)."""


def nearest(curve: list[dict], samples: int) -> dict | None:
    """The evaluation of ``curve`` (v0 left out) nearest to ``samples`` trained, if within
    ``EQUAL_SAMPLES_TOLERANCE`` of it."""
    near = min((c for c in curve if c["samples"] > 0), key=lambda c: abs(c["samples"] - samples), default=None)
    return near if near is not None and abs(near["samples"] - samples) <= EQUAL_SAMPLES_TOLERANCE * samples else None


def paired(runs: list[dict], names: list[str]) -> list[dict]:
    """Each rule against the first (the default): at every sample count > 0 the default's run of a
    (seed, repeat) pair evaluated and the rule's run evaluated too (``nearest``), the rule's pass@1
    minus the default's, in points; the mean per pair, the mean over the pairs and the standard
    error between the pairs (points inside one run are not independent draws, pairs are)."""
    out = []
    base = names[0]
    for rule in names[1:]:
        per_pair, points = [], 0
        for b in (x for x in runs if x["rule"] == base):
            other = next((x for x in runs if x["rule"] == rule and (x["seed"], x["repeat"]) == (b["seed"], b["repeat"])), None)  # fmt: skip
            if other is None:
                continue
            both = [(c, o) for c in b["curve"] if c["samples"] > 0 and (o := nearest(other["curve"], c["samples"]))]
            if not both:
                continue
            diffs = [100.0 * (o["pass_at_1"] - d["pass_at_1"]) for d, o in both]
            points += len(diffs)
            per_pair.append({"seed": b["seed"], "repeat": b["repeat"], "points": len(diffs),
                             "samples": [d["samples"] for d, _ in both], "diffs": [round(x, 1) for x in diffs],
                             "rule_samples": [o["samples"] for _, o in both],
                             "mean": round(sum(diffs) / len(diffs), 2),
                             "answer_tokens": _mean_pair(both, "response_tokens")})  # fmt: skip
        means = [p["mean"] for p in per_pair]
        n = len(means)
        mean = sum(means) / n if n else None
        se = (sum((m - mean) ** 2 for m in means) / (n - 1) / n) ** 0.5 if n > 1 else None
        out.append({"rule": rule, "against": base, "pairs": per_pair, "points": points,
                    "mean_points": None if mean is None else round(mean, 2),
                    "se_points": None if se is None else round(se, 2)})  # fmt: skip
    return out


def _mean_pair(both: list[tuple[dict, dict]], key: str) -> list[float | None]:
    """The mean of ``key`` over the points, for the default's run and the rule's (None where absent)."""
    out = []
    for side in (0, 1):
        vals = [p[side][key] for p in both if p[side].get(key) is not None]
        out.append(round(sum(vals) / len(vals), 1) if vals else None)
    return out


def table(result: dict) -> str:
    return md_table(
        ["rule", "seed", "k", "status", "steps", "samples", "stale dropped", "step s (mean)", "pass@1 v0", "final (version)",
         "best", "pass@1 at equal samples", f"time to v0 + {result['target_gain']:g}", "samples to it",
         "load avg at start"],
        [[r["rule"] + (f" ({r['from']})" if r.get("from") else ""), r.get("seed", 0), r["k"], r["status"], r["steps"], r["samples_trained"], r["stale_dropped"], r["mean_step_s"],
          r["pass_at_1_v0"], f"{r['pass_at_1_final']} (v{r['final_version']})", r["pass_at_1_best"],
          f"{r['pass_at_1_at_common']} ({r['samples_common']})",
          "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s",
          "-" if r["samples_to_target"] is None else r["samples_to_target"], r["loadavg_at_start"]]
         for r in result["runs"]],
    ) + "".join(_paired_lines(p) for p in result.get("paired", []))  # fmt: skip


def _paired_lines(p: dict) -> str:
    """The paired comparison under the table: per pair, then over the pairs."""
    rows = [[f"seed {x['seed']}" + (f" r{x['repeat']}" if x["repeat"] else ""), x["points"],
             ", ".join(f"{d:+.1f} ({_at(s, r)})" for d, s, r in zip(x["diffs"], x["samples"], x.get("rule_samples", x["samples"]), strict=True)),
             f"{x['mean']:+.2f}",
             " / ".join("-" if t is None else f"{t:g}" for t in x["answer_tokens"])]
            for x in p["pairs"]]  # fmt: skip
    over = "-" if p["mean_points"] is None else f"{p['mean_points']:+.2f}"
    over += "" if p["se_points"] is None else f" (standard error between the pairs {p['se_points']:.2f})"
    rows.append([f"mean of {len(p['pairs'])} pairs", p["points"], "", over, ""])
    head = [f"{p['rule']} - {p['against']}", "points", "pass@1 difference in points (samples)", "mean",
            "eval answer tokens (default / rule)"]  # fmt: skip
    return "\n\n" + md_table(head, rows)


def _at(samples: int, rule_samples: int) -> str:
    return str(samples) if samples == rule_samples else f"{samples} / {rule_samples}"


def plot(out: Path, result: dict) -> list[Path]:
    return learn.plot_curves(
        out / "barrier.png",
        result["runs"],
        lambda r: f"{r['rule']} ({r['name'].rsplit('-', 1)[-1]})",
        f"past the group barrier against the default rule: {result['recipe']}, k = {result['k']}",
        fontsize=8,
    )
