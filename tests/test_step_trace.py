"""``rlstream bench trace`` (rlstream.dev.bench.step_trace): the hops of a k = 0 step, from the
records' timestamps and the steps log, add up to the interval between two steps, each measured
from the right mark. Hand-made records with known times; the bench tier runs the real job
(tests/test_bench.py)."""

from rlstream.dev.bench.step_trace import HOPS, hops, summarize


def test_the_hops_of_a_step_add_up_to_its_interval_each_from_its_own_mark():
    t0 = 1_700_000_000.0  # step 2 ends (epoch s)
    steps = [
        # each entry's version is the one its step started from: step 2 made v2, step 3 made v3
        {"step": 2, "version": 1, "time": t0, "step_time_s": 0.02, "used": ["a/0"]},
        {"step": 3, "version": 2, "time": t0 + 0.5, "step_time_s": 0.03, "used": ["a/0", "a/1"]},
        {"step": 4, "version": 3, "time": t0 + 1.0, "step_time_s": 0.03, "used": ["b/0"]},  # no notice v3
    ]
    ms = int(t0 * 1000)
    notices = {2: (ms + 60, {"version": 2, "created_at_ms": ms + 50})}
    rollouts = {
        "a/0": (ms + 250, {"gen_started_at_ms": ms + 100, "gen_finished_at_ms": ms + 200}),
        "a/1": (ms + 260, {"gen_started_at_ms": ms + 110, "gen_finished_at_ms": ms + 240}),
        "b/0": (ms + 900, {"gen_started_at_ms": ms + 800, "gen_finished_at_ms": ms + 850}),
    }
    scored = {t: (ms + 330, {"scored_at_ms": ms + 300}) for t in ("a/0", "a/1", "b/0")}
    rows = hops(steps, notices, rollouts, scored)
    assert [r["step"] for r in rows] == [3]  # step 2 has no step before it traced; step 4 no notice
    r = rows[0]
    want = {"checkpoint": 50, "notice": 10, "to generation": 40, "generation": 140, "to rl.rollouts": 20,
            "reward": 40, "to rl.scored": 30, "to the trainer": 140, "optimizer": 30}  # fmt: skip
    assert {h: round(r[h]) for h in HOPS} == want
    assert round(sum(r[h] for h in HOPS)) == round(r["interval_ms"]) == 500
    assert summarize(rows)["generation"] == {"p50": 140.0, "p90": 140.0}
