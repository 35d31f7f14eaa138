"""`rlstream bench learn`'s analysis: time and samples to the target gain, the final and best
pass@1, stale drops; a run that never reaches the target says so."""

from rlstream.dev.bench.learn import summarize, table


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
