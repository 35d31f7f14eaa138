"""`rlstream bench all --size tiny` through the real CLI against the test broker: every benchmark
runs end to end and writes well-formed results (JSON keys, finite numbers that must be positive,
fractions in [0, 1]), PNG plots and the generated blocks of a docs file. Timings are not asserted:
the figures depend on the machine and on what else runs on it."""

import json
import math
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def fraction(x) -> bool:
    return isinstance(x, int | float) and -1e-9 <= x <= 1 + 1e-9


@pytest.mark.bench  # out of the default run (pyproject addopts): pytest -m bench
def test_bench_all_tiny(cli_env, kafka_bootstrap, tmp_path):
    out, docs = tmp_path / "bench", tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text(
        "# Benchmarks\n\nHand-written text stays.\n\n<!-- bench:async -->\nold table\n<!-- /bench:async -->\n"
    )
    proc = run_cli(
        ["bench", "all", "--size", "tiny", "--bootstrap", kafka_bootstrap, "--out", str(out), "--docs", str(docs)],
        cli_env,
        timeout=1500,  # a guard against a hang, not a speed target: ~4-5 min quiet, more at load 10+
    )
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["results"]) == {"async", "agentic", "transport", "weights", "scaling", "ceiling"}
    assert summary["size"] == "tiny" and positive(summary["total_seconds"])

    a = json.loads((out / "async.json").read_text())
    assert {(r["engine"], r["k"]) for r in a["runs"]} == {("sim", 0), ("sim", 1), ("hf", 0)}
    for r in a["runs"]:
        assert r["status"] == "ok", r
        assert r["steps_completed"] == a["sizes"][r["engine"]]["steps"]
        for key in ("samples_per_s", "tokens_per_s", "window_s", "speedup_over_k0", "step_period_s"):
            assert positive(r[key]), (key, r)
        for key in ("trainer_idle_fraction", "rollout_idle_fraction", "rollout_worker_empty_fraction"):
            assert fraction(r[key]), (key, r)
        assert isinstance(r["stale_dropped"], int) and r["stale_dropped"] >= 0
        assert sum(r["staleness_histogram"].values()) + r["stale_dropped"] >= r["samples_trained"]
        assert max(int(d) for d in r["staleness_histogram"]) <= r["k"]  # the hard bound, as trained
        if r["engine"] == "sim":
            for key in ("generation_capacity_samples_per_s", "training_capacity_samples_per_s", "ideal_samples_per_s"):
                assert positive(r["plan"][key]), key
            assert positive(r["achieved_over_ideal"])
    assert next(r for r in a["runs"] if r["k"] == 0 and r["engine"] == "sim")["speedup_over_k0"] == 1.0
    over = [r for r in a["runs"] if r["overprovision"]]  # rollout.overprovision = 1: one aborted per group
    assert len(over) == 1 and over[0]["overprovision_aborted_samples"] >= over[0]["steps_completed"] * 2, over

    g = json.loads((out / "agentic.json").read_text())
    assert [[r["mode"], r["k"]] for r in g["runs"]] == g["sizes"]["runs"]
    assert {r["mode"] for r in g["runs"]} == {"turn-sync", "env-async"}
    for r in g["runs"]:
        assert r["status"] == "ok", r
        assert r["steps_completed"] == g["sizes"]["steps"]
        for key in ("samples_per_s", "wall_s", "speedup_over_sync", "speedup_over_env_async_k0", "achieved_over_ideal"):
            assert positive(r[key]), (key, r)
        for key in ("trainer_idle_fraction", "rollout_idle_fraction"):
            assert fraction(r[key]), (key, r)
        assert positive(r["env.tool_calls"]) and r["dead_letters"] == 0
        assert max(int(d) for d in r["staleness_histogram"]) <= r["k"]
    assert next(r for r in g["runs"] if r["mode"] == "turn-sync" and r["k"] == 0)["speedup_over_sync"] == 1.0
    for key in ("generation_capacity_samples_per_s", "ideal_samples_per_s", "ideal_sync_samples_per_s"):
        assert positive(g["plan"][key]), key

    t = json.loads((out / "transport.json").read_text())
    assert t["status"] == {"reward": "ok", "trainer": "ok"}
    assert t["rlstream"]["scored_records"] == t["trajectories"] > 0
    for section, keys in (
        ("rlstream", ["produce_msgs_per_s", "produce_MB_per_s", "reward_stage_msgs_per_s", "trainer_msgs_per_s"]),
        ("raw", ["produce_msgs_per_s", "produce_MB_per_s", "consume_msgs_per_s", "consume_MB_per_s"]),
        ("raw_passthrough", ["msgs_per_s", "MB_per_s"]),
        ("ratios", ["produce_vs_raw_produce", "reward_stage_vs_raw_passthrough", "trainer_vs_raw_consume"]),
    ):
        for key in keys:
            assert positive(t[section][key]), (section, key, t[section])
    assert t["raw"]["consumed"] == t["raw"]["messages"] and t["raw"]["delivery_errors"] == 0

    w = json.loads((out / "weights.json").read_text())
    for r in w["notice"]:
        assert r["status"] == "ok" and r["versions_measured"] >= 1
        for key in ("all_loaded_ms_p50", "all_loaded_ms_p99", "per_worker_ms_p50", "fetch_verify_ms_p50"):
            assert positive(r[key]), (key, r)
        assert r["all_loaded_ms_p99"] >= r["all_loaded_ms_p50"]
    for r in w["sizes"]:
        assert r["status"] == "ok"
        for key in ("checkpoint_MB", "trainer_write_ms_p50", "fetch_verify_ms_p50", "notice_to_loaded_ms_p50"):
            assert positive(r[key]), (key, r)

    s = json.loads((out / "scaling.json").read_text())
    assert [(r["stage"], r["workers"]) for r in s["runs"]] == [
        ("reward", 1),
        ("reward", 2),
        ("rollout", 1),
        ("rollout", 2),
    ]
    for r in s["runs"]:
        assert r["status"] == "ok" and r["records"] > 0
        assert positive(r["records_per_s"]) and positive(r["speedup_over_1"])
        assert positive(r["worker_cpu_ms_per_record"])
    assert s["join"]["stable"] and positive(s["join"]["rebalance_s"])
    if s["runs"][0]["broker_cpu_ms_per_record"] is not None:  # None when the broker is not ours (KAFKA_BOOTSTRAP)
        assert positive(s["projection"]["broker_samples_per_s_per_core"])

    c = json.loads((out / "ceiling.json").read_text())
    assert {(r["k"], r["rule"]) for r in c["rows"]} == {(0, "sample"), (2, "sample"), (2, "token")}
    for r in c["rows"]:  # first-n trains shorter samples: more samples than the ideal, never more tokens
        ratio = r["tokens_over_ideal"] if r["policy"] == "first-n" else r["achieved_over_ideal"]
        assert fraction(ratio) and fraction(r["stale_dropped_fraction"]), r

    for result in summary["results"].values():
        assert result["plots"]
        for png in result["plots"]:
            assert Path(png).stat().st_size > 1000
    text = docs.read_text()
    assert "Hand-written text stays." in text and "old table" not in text
    for name in ("async", "agentic", "transport", "weights", "scaling", "ceiling"):
        assert f"<!-- bench:{name} -->" in text and f"<!-- /bench:{name} -->" in text
    assert "| engine | workload | k |" in text
    for png in (docs.parent / "img" / "bench").iterdir():
        assert png.suffix == ".png" and f"img/bench/{png.name}" in text
    assert "async vs sync" in proc.stderr + proc.stdout


def test_sigterm_stops_the_bench_roles_and_its_own_broker(cli_env, tmp_path):
    """A bench without --bootstrap starts a temporary broker; SIGTERM must stop it and the roles
    (they were orphaned before: Python died on the signal without running its cleanup)."""
    import re
    import signal
    import subprocess
    import time

    from pipeline.ports import pid_alive
    from tests.conftest import rlstream_cmd

    args = [*rlstream_cmd(), "bench", "async", "--size", "full", "--engine", "sim", "--out", str(tmp_path / "b")]
    log = tmp_path / "bench.log"
    env = {k: v for k, v in cli_env.items() if k != "RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"}  # its own broker
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"broker running: pid (\d+)", log.read_text())) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        assert m, "the bench never started its broker"
        broker = int(m.group(1))
        time.sleep(5)  # into the first run: roles started
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while pid_alive(broker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not pid_alive(broker), "the bench's broker outlived it"
    assert "broker stopped" in log.read_text()


@pytest.mark.bench
def test_bench_peer_tiny(cli_env, kafka_bootstrap, tmp_path):
    """`rlstream bench peer --size tiny`: TRL's GRPOTrainer and rlstream k = 0, 1, 2 on next-digit,
    in turn, from the same weights; well-formed figures and a docs block (no timing asserted)."""
    pytest.importorskip("trl", reason="rlstream bench peer needs TRL: pip install -e '.[peer]'")
    out, docs = tmp_path / "bench", tmp_path / "benchmarks.md"
    run_cli(
        ["bench", "peer", "--size", "tiny", "--bootstrap", kafka_bootstrap, "--out", str(out), "--docs", str(docs)],
        cli_env,
        timeout=1200,  # a guard against a hang: ~3-4 min quiet
    )
    p = json.loads((out / "peer.json").read_text())
    assert [r["arm"] for r in p["runs"]] == [
        "trl",
        "rlstream k=0",
        "rlstream k=1",
        "rlstream k=2",
        "rlstream k=2, cold broker",
    ]
    cold = p["runs"][-1]  # a broker of its own, started for it, stopped after it
    assert positive(cold["broker_start_s"]) and positive(cold["broker_cpu_s"]), cold
    # where its CPU went, by process, and the broker's requests (Kafka's counters over JMX)
    assert {"launcher", "forkserver", "trainer", "broker"} <= set(cold["cpu_by_process"]), cold["cpu_by_process"]
    assert positive(cold["cpu_by_process"]["trainer"]) and positive(cold["cpu_by_process"]["broker"])
    assert cold["broker_requests"].get("Fetch", 0) > 0 and cold["broker_requests"].get("EndTxn", 0) > 0
    for r in p["runs"]:
        assert r["status"] in ("ok", "finished"), r
        assert r["steps"] == p["steps"] and r["samples_trained"] > 0
        for key in ("time_to_steps_s", "first_step_s", "samples_per_cpu_s", "longest_pause_s", "cpu_s"):
            assert positive(r[key]), (key, r)
        assert r["time_to_steps_s"] >= r["first_step_s"]
        assert r["weights"] == p["weights"]["digest"]  # TRL: what it loaded; rlstream: the same directory
    trl = p["runs"][0]
    assert trl["weights_rlstream_loader"] == trl["weights"]
    assert all(r["stage_pause_s"] is not None for r in p["runs"][1:])
    assert [m["arm"] for m in p["medians"]] == [r["arm"] for r in p["runs"]]
    assert p["ratio_best_over_trl"] is not None and positive(p["ratio_best_over_trl"]["time_to_steps_s"])
    assert p["ratio_cold_over_trl"]["arm"] == cold["arm"] and positive(p["ratio_cold_over_trl"]["time_to_steps_s"])
    assert Path(p["plots"][0]).stat().st_size > 1000
    text = docs.read_text()
    assert "<!-- bench:peer -->" in text and "| arm (median) |" in text and "img/bench/peer.png" in text
    assert "| process (cold arm, median of runs) |" in text and "| broker requests (cold arm" in text


@pytest.mark.bench
def test_bench_trace_tiny(cli_env, kafka_bootstrap, tmp_path):
    """`rlstream bench trace --size tiny`: a k = 0 next-digit job, and per traced step the hops
    round the loop, which add up to the step interval (no timing asserted)."""
    from rlstream.dev.bench.step_trace import HOPS

    out, docs = tmp_path / "bench", tmp_path / "benchmarks.md"
    run_cli(
        ["bench", "trace", "--size", "tiny", "--bootstrap", kafka_bootstrap, "--out", str(out), "--docs", str(docs)],
        cli_env,
        timeout=900,  # a guard against a hang: ~1 min quiet
    )
    t = json.loads((out / "summary.json").read_text())["results"]["trace"]
    assert t["status"] == "finished" and len(t["rows"]) >= t["steps"] - 4, t["status"]
    for r in t["rows"]:
        assert abs(sum(r[h] for h in HOPS) - r["interval_ms"]) < 1.0, r  # one host's clock: exact
        assert r["interval_ms"] > 0 and r["optimizer"] > 0 and r["generation"] >= 0, r
    assert "<!-- bench:trace -->" in docs.read_text() and "| hop of a k = 0 step (ms) |" in docs.read_text()


def test_bench_peer_without_trl_says_how_to_install(tmp_path):
    """Without TRL (the peer extra), `rlstream bench peer` stops before it starts anything, naming
    the install line."""
    import importlib.util
    import os
    import subprocess

    from tests.conftest import rlstream_cmd

    if importlib.util.find_spec("trl") is not None:
        pytest.skip("TRL is installed here: the message is shown only without it")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env["RLSTREAM_HOME"] = str(tmp_path / "home")
    args = [*rlstream_cmd(), "bench", "peer", "--size", "tiny", "--out", str(tmp_path / "b")]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pip install trl==1.16.0" in proc.stdout + proc.stderr
    assert "broker" not in (proc.stdout + proc.stderr).lower()  # none was started
