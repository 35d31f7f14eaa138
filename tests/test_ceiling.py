"""The scheduling-ceiling model (``rlstream bench ceiling``): it follows the pipeline's rules
(admission, the hard bound, the worker's restart policy), so its figures move the way the rules
say they must. No Kafka: the model is plain Python, and the CLI runs it without a broker."""

import json
import os

import pytest

from rlstream.dev.bench.ceiling import Case, simulate
from tests.conftest import run_cli

STEPS = 120


def sim(k, rule="sample", policy="rollout", hops="none", dispatch="pull", extra=0):
    return simulate(Case(k, rule, policy, hops, STEPS, dispatch, extra))


def test_k0_is_synchronous_and_wastes_nothing():
    r = sim(0)
    assert r["steps"] == STEPS and r["stale_dropped_fraction"] == 0 and r["regenerated_fraction"] == 0
    assert r["achieved_over_ideal"] < 0.4  # generation and training take turns on the long tail
    assert r["rollout_idle_fraction"] > 0.5


def test_a_larger_staleness_bound_admits_more_overlap():
    a = [sim(k)["achieved_over_ideal"] for k in (0, 1, 2, 4)]
    assert a == sorted(a) and a[-1] > 0.9, a


def test_held_samples_are_regenerated_under_the_token_rule_and_not_when_lengths_are_known():
    rollout, known = sim(2, "token"), sim(2, "token", policy="clairvoyant")
    assert rollout["regenerated_fraction"] > 0.05 and rollout["stale_dropped_fraction"] < 0.02
    assert known["regenerated_fraction"] < 0.01 and known["stale_dropped_fraction"] < 0.01
    assert known["achieved_over_ideal"] > rollout["achieved_over_ideal"]


def test_first_n_of_an_over_provisioned_group_passes_the_barrier_by_training_shorter_samples():
    """``rollout.overprovision`` in the model: at k = 2 (token rule) the first n of n + 1 finish
    sooner than all n, so more samples train per second with little regenerated, at the price of
    aborted draws and a shorter trained mean; at k = 0 nothing goes stale either way."""
    base = sim(2, "token", hops="measured", dispatch="paced")
    first = sim(2, "token", "first-n", "measured", "paced", extra=1)
    assert first["achieved_over_ideal"] > base["achieved_over_ideal"] + 0.05, (first, base)
    assert first["regenerated_fraction"] < base["regenerated_fraction"] and first["stale_dropped_fraction"] < 0.02
    assert 0.05 < first["aborted_fraction"] < 0.2 and base["aborted_fraction"] == 0
    assert first["trained_mean_tokens"] < base["trained_mean_tokens"] <= base["mean_tokens"] * 1.1
    assert sim(0, policy="first-n", extra=2)["stale_dropped_fraction"] == 0


@pytest.mark.parametrize("k", [2, 4])
def test_hops_and_the_feeds_placement_only_cost(k):
    ideal = sim(k, "token" if k == 2 else "sample")["achieved_over_ideal"]
    real = sim(k, "token" if k == 2 else "sample", hops="measured", dispatch="paced")["achieved_over_ideal"]
    assert real <= ideal + 0.02  # a few steps' noise either way, never a gain from delay


def test_the_cli_runs_the_model_without_a_broker(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLSTREAM_", "KAFKA_"))}
    env.update(RLSTREAM_RUN_DIR=str(tmp_path / "runs"), RLSTREAM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    proc = run_cli(["bench", "ceiling", "--size", "tiny", "--out", str(tmp_path / "b")], env, timeout=300)
    assert "broker running" not in proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "b" / "ceiling.json").read_text())["rows"]
    assert len(rows) == 18 and all(0 < r["tokens_over_ideal"] <= 1 for r in rows)
    assert all(r["achieved_over_ideal"] <= 1 for r in rows if r["policy"] != "first-n")


def test_the_model_repeats_exactly():
    """Run after run, in one process: nothing may follow a set's order (object ids)."""
    for case in (Case(2, "token", "rollout", "none", 400), Case(2, "sample", "rollout", "measured", 400)):
        first = simulate(case)
        assert all(simulate(case) == first for _ in range(3)), case
