"""`rlstream bench staleness`: its statistics on known numbers (samples to target, reward at equal
samples, t and Welch intervals, the "as well" verdict), its resume (a results file that holds every
requested run starts nothing), and one real short run through the CLI against the test broker."""

import json
import math

import pytest

from rlstream.dev.bench import staleness as st
from tests.conftest import run_cli


def curve(rewards: list[float], per_step: int = 64) -> list[list]:
    return [[per_step * (i + 1), r] for i, r in enumerate(rewards)]


def test_figures_read_the_rolling_target_and_equal_samples():
    c = curve([0.0] * 10 + [0.9] * 10)  # the 5-step mean first reaches 0.8 at step 15
    f = st.figures(c, target=0.8, equal_samples=64 * 12)
    assert f["samples_to_target"] == 64 * 15
    assert f["reward_at_equal_samples"] == pytest.approx((3 * 0.0 + 2 * 0.9) / 5)
    never = st.figures(curve([0.5] * 20), target=0.8, equal_samples=64 * 30)
    assert never == {"samples_to_target": None, "reward_at_equal_samples": None}  # short of both
    gaps = [[64, None], *curve([1.0] * 6)[1:]]  # a step that trained nothing is no point of the mean
    assert st.figures(gaps, 0.8, 64 * 6)["samples_to_target"] == 64 * 6


def test_t_and_welch_intervals():
    c = st.mean_ci([1.0, 2.0, 3.0])
    assert c["mean"] == 2.0 and c["se"] == pytest.approx(1 / math.sqrt(3))
    assert c["hi"] - c["mean"] == pytest.approx(4.303 / math.sqrt(3), rel=1e-6)
    assert st.mean_ci([5.0])["lo"] is None and st.mean_ci([])["mean"] is None
    assert st.t95(19) == 2.093 and st.t95(21) == 2.086 and st.t95(500) == 1.96
    d = st.welch(st.mean_ci([3.0, 4.0, 5.0]), c)
    assert d["diff"] == pytest.approx(2.0) and d["lo"] < 2.0 < d["hi"]
    # equal variances and n: df = 2 (n - 1) = 4
    assert d["hi"] - d["diff"] == pytest.approx(2.776 * math.sqrt(2 / 3), rel=1e-6)


def test_summarize_says_which_arms_learn_as_well():
    base = [[0.0] * 10 + [0.9] * 20, [0.0] * 11 + [0.9] * 19, [0.0] * 9 + [0.9] * 21]
    slow = [[0.0] * 20 + [0.9] * 10, [0.0] * 21 + [0.9] * 9, [0.0] * 19 + [0.9] * 11]
    runs = [
        {"arm": arm, "seed": s, "curve": curve(r), "mean_lag": lag, "stale_dropped": 0}
        for arm, rs, lag in (("k=0", base, 0.0), ("k=2 default", base, 0.5), ("k=4 decoupled", slow, 3.0))
        for s, r in enumerate(rs)
    ]
    sz = {"target": 0.8, "equal_samples": 64 * 15}
    out = {r["arm"]: r for r in st.summarize(runs, ["k=0", "k=2 default", "k=4 decoupled"], sz)}
    assert out["k=0"]["samples_to_target"]["mean"] == 64 * 15 and out["k=0"]["as_well"]["samples_to_target"] is None
    assert out["k=2 default"]["as_well"] == {"samples_to_target": True, "reward_at_equal_samples": True}
    assert out["k=4 decoupled"]["as_well"] == {"samples_to_target": False, "reward_at_equal_samples": False}
    assert out["k=4 decoupled"]["samples_to_target_diff"]["diff"] == pytest.approx(640 - 3 * 64)  # lag 3: 3 steps back
    assert out["k=4 decoupled"]["mean_lag"]["mean"] == 3.0 and out["k=2 default"]["runs"] == 3
    text = st.table({**_result(sz), "summary": list(out.values())})
    assert "| k=4 decoupled | 3 |" in text and "| no |" in text and "| yes |" in text


def _result(sz: dict) -> dict:
    return {**sz, "recipe": "examples/next-digit.toml", "steps": 30, "seeds": [0, 1, 2], "window": st.WINDOW,
            "arms": ["k=0", "k=2 default", "k=4 decoupled"], "margin": st.MARGIN, "load_during": [1.0, 2.5, 1.8],
            "failed": 0}  # fmt: skip


def test_seeds_and_arms_options():
    assert st.seeds_of({"seeds": [3]}, "full") == [0, 1, 2]
    assert st.seeds_of({"seeds": [3, 7]}, "full") == [3, 7]
    assert st.seeds_of({}, "full") == list(range(20))
    with pytest.raises(ValueError, match="unknown"):
        st.arms_of({"arms": ["k=3"]})


def test_a_results_file_holding_every_run_starts_nothing(tmp_path, monkeypatch):
    from rlstream.dev.bench.harness import BenchContext

    def refuse(*a, **k):
        raise AssertionError("a run that the results file holds was started again")

    monkeypatch.setattr(st, "run_one", refuse)
    runs = [{"task": "next-digit", "arm": a, "k": st.ARMS[a][0], "seed": s, "name": f"{a}-{s}", "status": "finished",
             "wall_s": 20.0, "loadavg": [1.0, 2.0], "steps": 30, "samples_trained": 1920, "stale_dropped": 0,
             "mean_lag": 0.0, "curve": curve([0.1 * (i // 3) for i in range(30)])}
            for s in (0, 1) for a in ("k=0", "k=2 default")]  # fmt: skip
    # a killed run of a seed that finished later stays out of the figures
    runs.append({**runs[0], "status": "budget spent"})
    (tmp_path / st.RESULTS).write_text(json.dumps({"runs": runs}))
    ctx = BenchContext(
        tmp_path, "unused:1", None, [], "tiny", "x", lambda *a: None, extra={"arms": ["k=0", "k=2 default"]}
    )
    got = st.run(ctx)
    assert [r["runs"] for r in got["summary"]] == [2, 2] and got["load_during"] == [1.0, 2.0, 1.5]
    assert got["failed"] == 0 and len(json.loads((tmp_path / st.RESULTS).read_text())["runs"]) == 4
    assert (tmp_path / "staleness-next-digit.png").stat().st_size > 1000


@pytest.mark.kafka
@pytest.mark.slow
def test_bench_staleness_tiny(cli_env, kafka_bootstrap, tmp_path):
    """One seed of two arms, 30 steps each, through the CLI: the results file, the table in the
    docs block and the plot (no learning asserted: 30 steps is a smoke test)."""
    out, docs = tmp_path / "bench", tmp_path / "performance.md"
    args = ["bench", "staleness", "--size", "tiny", "--seeds", "1", "--arms", "k=0,k=2 default"]
    run_cli([*args, "--bootstrap", kafka_bootstrap, "--out", str(out), "--docs", str(docs)], cli_env, timeout=900)
    res = json.loads((out / st.RESULTS).read_text())
    assert [(r["arm"], r["status"], r["steps"]) for r in res["runs"]] == [
        ("k=0", "finished", 30),
        ("k=2 default", "finished", 30),
    ]
    assert res["runs"][0]["mean_lag"] == 0.0 and res["runs"][0]["curve"][-1][0] == res["runs"][0]["samples_trained"]
    assert all(r["reward_at_equal_samples"]["n"] == 0 for r in res["summary"])  # 30 steps < 2560 samples
    text = docs.read_text()
    assert "<!-- bench:staleness -->" in text and "| k=2 default | 1 |" in text
    assert "img/bench/staleness-next-digit.png" in text
    bad = run_cli(["bench", "staleness", "--arms", "k=3", "--bootstrap", kafka_bootstrap], cli_env, check=False)
    assert bad.returncode != 0 and "the arms are" in bad.stdout + bad.stderr


def test_a_run_that_never_reaches_the_target_counts_at_its_total():
    runs = [
        {"arm": "k=0", "seed": 0, "curve": curve([0.0] * 10 + [0.9] * 10), "mean_lag": 0.0, "stale_dropped": 0},
        {"arm": "k=0", "seed": 1, "curve": curve([0.1] * 30), "mean_lag": 0.0, "stale_dropped": 0},
    ]
    (row,) = st.summarize(runs, ["k=0"], {"target": 0.8, "equal_samples": 64 * 15})
    assert row["not_reached"] == 1 and row["samples_to_target"]["mean"] == (64 * 15 + 64 * 30) / 2
