"""`rlstream bench learn`'s analysis: time and samples to the target gain, the final and best
pass@1, stale drops; a run that never reaches the target says so."""

import os

import pytest

from rlstream.dev.bench.learn import summarize, table, version_points


def _curve(points):
    return [{"version": v, "pass_at_1": p, "reward_mean": p, "wall_s": 10.0 * v, "samples": 32 * v} for v, p in points]


def test_time_and_samples_to_the_target_and_the_counts():
    steps = [{"used": ["a"] * 32, "stale": ["s"] if i == 3 else [], "step_time_s": 2.0} for i in range(30)]
    r = summarize(_curve([(0, 0.1), (10, 0.2), (20, 0.31), (30, 0.28)]), steps, 0.2)
    assert r["pass_at_1_v0"] == 0.1 and r["target"] == 0.3
    assert r["time_to_target_s"] == 200.0 and r["samples_to_target"] == 640
    assert r["pass_at_1_final"] == 0.28 and r["final_version"] == 30 and r["pass_at_1_best"] == 0.31
    assert r["steps"] == 30 and r["samples_trained"] == 960 and r["stale_dropped"] == 1 and r["mean_step_s"] == 2.0


def test_a_run_that_never_reaches_the_target_or_has_no_v0_eval():
    r = summarize(_curve([(0, 0.1), (10, 0.2)]), [], 0.2)
    assert r["time_to_target_s"] is None and r["samples_to_target"] is None and r["mean_step_s"] is None
    assert summarize(_curve([(10, 0.5)]), [], 0.2)["target"] is None
    row = {"k": 1, "status": "budget spent", "curve": [], "loadavg_at_start": 1.0, **r}
    assert "| 1 | budget spent |" in table({"target_gain": 0.2, "runs": [row]})


def test_the_barrier_bench_compares_rules_at_equal_samples():
    from rlstream.dev.bench.barrier import at_samples
    from rlstream.dev.bench.barrier import table as barrier_table

    curve = _curve([(0, 0.1), (10, 0.2), (20, 0.31)])
    assert at_samples(curve, 640) == 0.31 and at_samples(curve, 639) == 0.2 and at_samples(curve, -1) is None
    r = summarize(curve, [], 0.2)
    row = {"rule": "overprovision 2", "k": 1, "status": "budget spent", "curve": curve, "loadavg_at_start": 1.0,
           "pass_at_1_at_common": 0.2, "samples_common": 320, **r}  # fmt: skip
    assert "| overprovision 2 | 0 | 1 | budget spent |" in barrier_table({"target_gain": 0.2, "runs": [row]})
    assert "| 0.2 (320) |" in barrier_table({"target_gain": 0.2, "runs": [row]})


def test_a_version_is_placed_at_the_end_of_the_step_that_made_it():
    """The steps log names the version a step started from: step 1 (version 0) makes version 1."""
    steps = [{"step": i + 1, "version": i, "time": 100.0 + 10 * (i + 1), "used": ["a"] * 32} for i in range(3)]
    assert version_points(steps, 100.0) == {0: (0.0, 0), 1: (10.0, 32), 2: (20.0, 64), 3: (30.0, 96)}


def test_the_barrier_bench_pairs_each_seeds_runs_at_equal_samples_and_averages_over_seeds():
    """Mode minus default at every sample count both runs of a seed evaluated (v0 left out), a mean
    per seed, the mean over seeds and the standard error between them; a rule's run without its
    default partner is left out rather than compared with another seed's."""
    from rlstream.dev.bench.barrier import paired, run_sets, seed_sets
    from rlstream.dev.bench.barrier import table as barrier_table

    def row(rule, seed, points):
        curve = _curve(points)
        for c in curve:
            c["response_tokens"] = 12.0 if rule == "default" else 10.0
        return {"rule": rule, "seed": seed, "repeat": 0, "curve": curve}

    runs = [
        row("default", 0, [(0, 0.1), (10, 0.2), (20, 0.4)]),
        row("over", 0, [(0, 0.1), (10, 0.24), (20, 0.36), (30, 0.5)]),  # v30: the default never got there
        row("default", 1, [(0, 0.1), (10, 0.3)]),
        row("over", 1, [(0, 0.1), (10, 0.2)]),
        row("over", 2, [(0, 0.1), (10, 0.9)]),  # no default run for seed 2
    ]
    [p] = paired(runs, ["default", "over"])
    assert [(x["seed"], x["samples"], x["diffs"]) for x in p["pairs"]] == [(0, [320, 640], [4.0, -4.0]), (1, [320], [-10.0])]  # fmt: skip
    assert p["points"] == 3 and p["mean_points"] == -5.0 and p["se_points"] == 5.0
    assert p["pairs"][0]["answer_tokens"] == [12.0, 10.0]
    text = barrier_table({"target_gain": 0.2, "runs": [], "paired": [p]})
    assert "| mean of 2 pairs | 3 |  | -5.00 (standard error between the pairs 5.00) |" in text
    assert "+4.0 (320), -4.0 (640)" in text
    assert seed_sets(3) == ["feed.shuffle_seed=3", "rollout.engine.seed=3", "trainer.seed=3"]
    assert run_sets("default other draws", 2)[-1] == "rollout.engine.seed=1002"  # the last one wins
    assert run_sets("quorum 6 of 8 tail", 2)[3:] == [
        "rl.group_size=6",
        "rollout.overprovision=2",
        "rollout.overprovision_tail=train",
    ]


def test_the_barrier_bench_pairs_new_runs_with_an_earlier_files_runs_of_the_other_rules(tmp_path):
    """``--against``: an earlier barrier.json's runs of other rules and the same seeds join the
    comparison, marked with their file; its runs of the rules being run again are not reused."""
    import json

    from rlstream.dev.bench.barrier import earlier_runs

    old = tmp_path / "barrier.json"
    runs = [{"rule": "default", "seed": 2, "curve": []}, {"rule": "default", "seed": 5, "curve": []},
            {"rule": "overprovision 2 tail", "seed": 2, "curve": []}]  # fmt: skip
    old.write_text(json.dumps({"runs": runs}))
    got = earlier_runs(str(old), ["overprovision 2 tail"], [2, 3])
    assert [(r["rule"], r["seed"], r["from"]) for r in got] == [("default", 2, "barrier.json")]
    assert earlier_runs(None, ["default"], [0]) == []
    with pytest.raises(ValueError, match="no run of another rule"):
        earlier_runs(str(old), ["default"], [7])


def test_equal_samples_pair_a_rule_evaluated_at_other_sample_counts_within_five_percent():
    from rlstream.dev.bench.barrier import nearest, paired

    curve = [{"samples": s, "pass_at_1": p} for s, p in ((0, 0.1), (312, 0.3), (648, 0.5), (1100, 0.6))]
    assert nearest(curve, 320)["samples"] == 312 and nearest(curve, 640)["samples"] == 648
    assert nearest(curve, 960) is None and nearest([{"samples": 0, "pass_at_1": 0.1}], 320) is None  # 14.6 % off; v0
    base = {"rule": "default", "seed": 0, "repeat": 0, "curve": _curve([(0, 0.1), (10, 0.2), (20, 0.4), (30, 0.5)])}
    [p] = paired([base, {"rule": "tail", "seed": 0, "repeat": 0, "curve": curve}], ["default", "tail"])
    [pair] = p["pairs"]
    assert (pair["samples"], pair["rule_samples"], pair["diffs"]) == ([320, 640], [312, 648], [10.0, 10.0])


def test_rules_are_checked_against_the_one_benchmark_that_has_them_before_anything_starts():
    import typer

    from rlstream.dev.commands import check_rules

    check_rules(["barrier"], ["default", "overprovision 2 tail"])
    check_rules(["async"], ["overprovision"])
    from rlstream.dev.bench.barrier import RULES

    assert not [r for r in RULES if "," in r]  # --rules is a comma list
    with pytest.raises(typer.BadParameter, match=r"barrier has no rule \['nope'\]; its rules are \['default'"):
        check_rules(["barrier"], ["nope"])
    with pytest.raises(typer.BadParameter, match="one benchmark run alone"):
        check_rules(["barrier", "async"], ["default"])


def test_ks_are_checked_before_anything_starts():
    import typer

    from rlstream.dev.commands import ks_option

    assert ks_option(["learn"], "0, 2") == [0, 2]
    for bad in ("0,x", "-1"):
        with pytest.raises(typer.BadParameter, match="comma list of integers >= 0"):
            ks_option(["learn"], bad)
    with pytest.raises(typer.BadParameter, match="learn benchmark run alone"):
        ks_option(["learn", "trl"], "0")


def test_the_async_table_names_a_quorum_below_the_draws():
    """An over-provisioned row says what it drew and trained: aborted samples, or the tail trained
    with the quorum the group closed at where that is below the draws."""
    from rlstream.dev.bench.async_sync import _overprovision

    assert _overprovision({"overprovision": 0}) == 0
    assert _overprovision({"overprovision": 1, "overprovision_aborted_samples": 5, "overprovision_discarded_tokens": 40}) == "5 (40)"  # fmt: skip
    assert _overprovision({"overprovision": 2, "overprovision_tail": "train"}) == "+2, tail trained"  # an old row
    assert _overprovision({"overprovision": 2, "overprovision_tail": "train", "quorum": 6}) == "quorum 6 of 8, tail trained"  # fmt: skip


def test_runs_over_seeds_are_summarised_per_k_with_intervals():
    """``--seeds``: per k, the mean time and samples to the target over the runs that reached it
    (the others counted as never reached), and pass@1 at the most samples every run was evaluated at."""
    from rlstream.dev.bench.learn import by_k

    def run(k, seed, points, hit):
        curve = _curve(points)
        r = summarize(curve, [], 0.2)
        return {"k": k, "seed": seed, "status": "budget spent", "curve": curve, "loadavg_at_start": 1.0, **r} | (
            {} if hit else {"time_to_target_s": None, "samples_to_target": None}
        )

    runs = [
        run(0, 0, [(0, 0.1), (10, 0.3), (20, 0.4)], True),
        run(0, 1, [(0, 0.1), (10, 0.2), (20, 0.5), (30, 0.6)], True),
        run(1, 0, [(0, 0.1), (10, 0.15), (20, 0.2)], False),
        run(1, 1, [(0, 0.1), (10, 0.35), (20, 0.45)], True),
    ]
    agg = by_k(runs)
    assert agg["common_samples"] == 640  # the shortest run was evaluated up to v20
    k0, k1 = agg["arms"]["0"], agg["arms"]["1"]
    assert k0["n"] == 2 and k0["never_reached"] == 0 and k0["time_to_target_s"]["mean"] == 150.0
    assert k0["time_to_target_s"]["lo"] < 150.0 < k0["time_to_target_s"]["hi"]
    assert k0["pass_at_1_at_common"]["mean"] == pytest.approx(0.45)
    assert k1["never_reached"] == 1 and k1["time_to_target_s"]["n"] == 1 and k1["time_to_target_s"]["lo"] is None
    text = table({"target_gain": 0.2, "runs": runs, "by_k": agg})
    assert "| 0 | 0 | budget spent |" in text and "pass@1 at 640 samples" in text
    assert "| 1 | 2 | 100 | 320 | 1 | 0.325 [" in text


def test_a_bench_continues_the_runs_an_earlier_invocation_left_in_its_out_dir(tmp_path):
    """Seed by seed, the arms' order alternating; the same ``--out`` keeps the completed runs (also
    those of other seeds, for a later invocation) and runs the failed and missing ones."""
    from rlstream.dev.bench.harness import in_plan, resume, schedule, write_json
    from rlstream.dev.bench.learn import completed, run_key

    assert schedule(["a", "b"], [0, 1], 2) == [
        (0, 0, "a"), (0, 0, "b"), (0, 1, "b"), (0, 1, "a"), (1, 0, "a"), (1, 0, "b"), (1, 1, "b"), (1, 1, "a"),
    ]  # fmt: skip
    plan = schedule([0, 2], [0, 1, 2])
    earlier = [
        {"seed": 0, "k": 0, "status": "budget spent"},
        {"seed": 0, "k": 2, "status": "exit 1"},  # failed: runs again
        {"seed": 7, "k": 0, "status": "finished"},  # another invocation's seed: kept, not run
    ]
    write_json(tmp_path / "learn.json", {"runs": earlier[:2], "other_runs": earlier[2:]})
    said = []
    runs, todo = resume(tmp_path / "learn.json", plan, run_key, completed, said.append)
    assert todo == [(0, 0, 2), (1, 0, 2), (1, 0, 0), (2, 0, 0), (2, 0, 2)]
    assert [r["seed"] for r in runs] == [0, 7] and said == [f"[bench] 2 completed runs in {tmp_path / 'learn.json'}; 5 of 6 to run"]  # fmt: skip
    later = {"seed": 1, "k": 2, "status": "budget spent", "repeat": 0}
    mine, others = in_plan([*runs, later], plan, run_key)
    assert mine == [runs[0], later] and others == [earlier[2]]
    assert resume(tmp_path / "none.json", plan, run_key, completed, said.append) == ([], plan) and len(said) == 1


def test_a_summarised_run_loses_its_checkpoints_and_weights_but_keeps_its_logs(tmp_path):
    from types import SimpleNamespace

    from rlstream.dev.bench.learn import prune

    run_dir = tmp_path / "learn" / "job"
    for d in ("trainer/ckpts/step-3", "checkpoints/weights/v3", "logs"):
        (run_dir / d).mkdir(parents=True)
        (run_dir / d / "f").write_text("x")
    (run_dir / "trainer" / "steps.jsonl").write_text("{}\n")
    shared = tmp_path / "shared-store"
    shared.mkdir()
    prune({"run_dir": run_dir}, SimpleNamespace(store=str(shared)))  # a store not the run's own stays
    assert shared.is_dir() and (run_dir / "checkpoints").is_dir() and not (run_dir / "trainer" / "ckpts").exists()
    prune({"run_dir": run_dir}, SimpleNamespace(store=str(run_dir / "checkpoints")))
    assert not (run_dir / "checkpoints").exists()
    assert (run_dir / "trainer" / "steps.jsonl").is_file() and (run_dir / "logs" / "f").is_file()


def test_the_trl_bench_summarises_each_engine_over_seeds(tmp_path):
    """Per engine: time to the target, pass@1 at equal samples and at the budget, samples per CPU-second;
    every run's curve in one plot."""
    from rlstream.dev.bench.learn import arms_table, over_seeds
    from rlstream.dev.bench.trl_peer import plot, run_key
    from rlstream.dev.bench.trl_peer import table as trl_table

    def run(engine, seed, points, rate):
        curve = _curve(points)
        return {"engine": engine, "seed": seed, "status": "ok", "steps": 30, "samples_trained": 960, "curve": curve,
                "samples_per_cpu_s": rate, "loadavg_at_start": 1.0, **summarize(curve, [], 0.2)}  # fmt: skip

    runs = [
        run("trl", 0, [(0, 0.1), (10, 0.2), (20, 0.3), (30, 0.5)], 0.8),
        run("rlstream k=1", 0, [(0, 0.1), (10, 0.3), (20, 0.4)], 1.0),
        run("trl", 1, [(0, 0.1), (10, 0.1), (20, 0.2), (30, 0.25)], 0.9),
        run("rlstream k=1", 1, [(0, 0.1), (10, 0.2), (20, 0.5)], 1.2),
    ]
    assert run_key(runs[1]) == (0, 0, "rlstream")
    agg = over_seeds(runs, lambda r: r["engine"], 150)
    trl, rl = agg["arms"]["trl"], agg["arms"]["rlstream k=1"]
    assert agg["common_samples"] == 640 and trl["pass_at_1_at_budget"]["mean"] == pytest.approx(0.15)
    assert rl["samples_per_cpu_s"]["mean"] == pytest.approx(1.1) and trl["never_reached"] == 1
    text = trl_table({"target_gain": 0.2, "runs": runs, "by_engine": agg})
    assert "| engine | runs | time to v0 + 0.2 (s) |" in text and "pass@1 at 150 s" in text
    assert "| rlstream k=1 | 2 | 150 [" in text and "samples / CPU-s |" in text
    assert plot(tmp_path, {"recipe": "r.toml", "runs": runs}) == [tmp_path / "trl.png"]
    # the broker's CPU is in rlstream's samples per CPU-second; runs from before it was measured show "-"
    assert "broker CPU s" not in text
    runs[3]["broker_cpu_s"] = 123.4
    shown = trl_table({"target_gain": 0.2, "runs": runs})
    assert "| broker CPU s |" in shown and "| 1.2 | 123 |" in shown and "| 0.8 | - |" in shown
    # two seeds: the t-interval reaches past what a time or a pass@1 can be; the table cuts it there
    wide = {"trl": {**trl, "time_to_target_s": {"mean": 590.0, "lo": -291.2, "hi": 1471.1},
                    "pass_at_1_at_common": {"mean": 0.714, "lo": 0.196, "hi": 1.233}}}  # fmt: skip
    assert "| 590 [0, 1471] |" in arms_table({**agg, "arms": wide}, 0.2, "engine")
    assert "| 0.714 [0.196, 1.000] |" in arms_table({**agg, "arms": wide}, 0.2, "engine")
    assert (tmp_path / "trl.png").stat().st_size > 1000


def test_the_cpu_a_process_used_since_a_reading_before():
    from rlstream.dev.bench.harness import cpu_seconds, cpu_since

    me = os.getpid()
    before = cpu_seconds(me)
    while cpu_seconds(me) - before < 0.3:  # CPU time, not wall time: done however loaded the machine is
        pass
    assert 0.3 <= cpu_since(me, before) < cpu_since(me, 0.0)
    assert cpu_since(None, None) == 0.0 and cpu_since(me, None) == 0.0  # no local broker, no reading before
