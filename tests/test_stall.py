"""No silent stall: dead letters by reason with their first message, a stage with
work and no progress named on screen, and a job stopped non-zero when no step is made for
``liveness.stall_s`` while work is dead-lettered. The folding and the decisions with synthetic
records and clock values (no Kafka, no sleeps); then a real job whose reward function raises, run
with the real CLI on the real broker, and ``rlstream status`` on what it left."""

from __future__ import annotations

import io
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, rlstream_cmd

T0 = 1_000_000.0  # the launcher's start, wall-clock seconds


def dead(t: float, reason: str = "ZeroDivisionError: division by zero", error_type="reward_error", role="reward"):
    return {"error_type": error_type, "reason": reason, "role": role, "worker_id": f"{role}-0",
            "failed_at_ms": int(t * 1000)}  # fmt: skip


def event(role: str, t: float, worker: str = "0", **metrics) -> dict:
    return {"role": role, "worker_id": f"{role}-{worker}", "version": 0, "timestamp_ms": int(t * 1000),
            "metrics": {k: float(v) for k, v in metrics.items()}, "labels": {}}  # fmt: skip


def test_dead_letters_are_counted_by_stage_and_reason_with_the_first_message_on_one_line():
    from rlstream.stall import DeadLetters

    d = DeadLetters()
    d.add(dead(T0 + 5, "ValueError: second\n  more detail"))
    d.add(dead(T0 + 1, "ValueError: first\nTraceback (most recent call last): ..."))  # earlier, read later
    d.add(dead(T0 + 2, "x" * 500, error_type="decode", role="reward"))
    d.add(dead(T0 + 3, "bad bytes", error_type="decode", role="trainer"))
    d.add_undecodable()
    assert d.total() == 5
    assert d.by_key[("reward", "reward_error")].count == 2
    assert d.by_key[("reward", "reward_error")].first == "ValueError: first"
    assert len(d.by_key[("reward", "decode")].first) == 200 and d.by_key[("reward", "decode")].first.endswith("...")
    assert {k: r.count for k, r in d.by_reason().items()} == {"decode": 2, "reward_error": 2,
                                                             "undecodable_dead_letter": 1}  # fmt: skip
    assert d.by_reason()["decode"].first.startswith("xxx")  # the earliest over both stages
    labels = d.labels()  # a reason from two stages is told apart by its stage
    assert set(labels) == {"reward_error", "reward/decode", "trainer/decode", "undecodable_dead_letter"}
    assert d.summary().startswith("reward_error 2 (ValueError: first)")
    assert "\n" not in d.summary()


def test_a_reward_function_that_raises_stalls_the_run_and_the_reason_is_said():
    from rlstream.stall import StallWatch

    w = StallWatch(T0, stall_s=20)
    w.add_dead_letter(dead(T0 - 3600, "an earlier run's error"))  # the topic is read from its start
    w.add_metric(event("rollout", T0 + 4, trajectories=64))
    w.add_metric(event("reward", T0 + 4, scored=0))
    for i in range(64):
        w.add_dead_letter(dead(T0 + 5 + i / 100))
    w.add_metric(event("trainer", T0 + 6, step=0))
    assert w.verdict(T0 + 19) is None  # not yet stall_s without a step
    lags = {"rollout": 40, "reward": 0, "trainer": 0}
    assert w.stalled(T0 + 12, lags) == ["reward (64 dead letters, nothing scored for 12 s)"]  # named after stall_s/2
    assert w.stalled(T0 + 8, lags) == []
    assert w.verdict(T0 + 21) == (
        "stalled: no step for 21 s; 64 dead letters (reward_error: ZeroDivisionError: division by zero)"
    )  # this run's 64, not the earlier run's one
    assert w.dead.summary() == "reward_error 65 (an earlier run's error)"  # the view counts the whole topic
    assert StallWatch(T0, stall_s=0).verdict(T0 + 10**6) is None  # 0 = off


def test_a_step_starts_a_new_window_and_a_restarted_worker_counts_as_progress():
    from rlstream.stall import StallWatch

    w = StallWatch(T0, stall_s=20)
    w.add_dead_letter(dead(T0 + 5))
    w.add_metric(event("trainer", T0 + 30, step=1))  # a step: the earlier dead letter is forgiven
    assert w.verdict(T0 + 49) is None and w.verdict(T0 + 500) is None  # no dead letter since the step
    w.add_metric(event("trainer", T0 + 40, step=1))  # a periodic event repeating step 1 is no step
    w.add_dead_letter(dead(T0 + 52, "RuntimeError: again", error_type="reward_timeout"))
    assert w.verdict(T0 + 49) is None
    assert w.verdict(T0 + 55) == "stalled: no step for 25 s; 1 dead letters (reward_timeout: RuntimeError: again)"

    w = StallWatch(T0, stall_s=300)
    w.add_metric(event("rollout", T0 + 10, trajectories=100))
    w.add_metric(event("rollout", T0 + 20, trajectories=3))  # restarted: its counters begin again
    assert w.progress_at["rollout"] == T0 + 20
    w.add_metric(event("rollout", T0 + 30, trajectories=3))  # no new trajectory
    assert w.progress_at["rollout"] == T0 + 20


def test_a_dataset_the_rollout_workers_cannot_use_names_the_rollout_stage():
    from rlstream.stall import StallWatch

    w = StallWatch(T0, stall_s=300)
    for i in range(10):
        w.add_dead_letter(dead(T0 + 10 + i, "prompt of 900 tokens > 512", error_type="too_long", role="rollout"))
    lags = {"rollout": 90, "reward": 0, "trainer": 0}
    assert w.stalled(T0 + 70, lags) == ["rollout (lag 90, 10 dead letters, no trajectory for 70 s)"]
    assert w.verdict(T0 + 299) is None
    assert w.verdict(T0 + 301).endswith("10 dead letters (too_long: prompt of 900 tokens > 512)")


def test_a_slow_job_is_never_stopped_and_its_slowest_stage_is_named_after_its_usual_step_time():
    from rlstream.stall import StallWatch

    w = StallWatch(T0, stall_s=300)
    for step in range(1, 5):  # a big model: a step every 100 s
        w.add_metric(event("trainer", T0 + 100 * step, step=step))
        w.add_metric(event("rollout", T0 + 100 * step, trajectories=64 * step))
    lags = {"rollout": 30, "reward": 0, "trainer": 64}  # the rollout workers wait for the trainer
    assert w.stalled(T0 + 400 + 250, lags) == []  # within 3 of its usual step times
    assert w.stalled(T0 + 400 + 310, lags) == ["trainer (lag 64, no step for 310 s)"]  # not the rollout too
    assert w.verdict(T0 + 400 + 10**5) is None  # no dead letters: never stopped


def test_the_live_view_the_plain_line_and_status_show_the_reason(tmp_path):
    from rich.console import Console

    from rlstream.config import load_config
    from rlstream.launcher import Launcher, standard_roles
    from rlstream.stall import StallWatch
    from rlstream.status import render as render_status

    cfg = load_config(None, [f"run_dir={tmp_path}", "liveness.stall_s=20"], environ={})
    launcher = Launcher(cfg, tmp_path, standard_roles(cfg, 1, 1), title="t", live=False, console=Console())
    launcher.stall = StallWatch(time.time() - 60, cfg.liveness.stall_s)
    launcher.stall.add_dead_letter(dead(time.time() - 30, "KeyError: [x] not found"))  # rich markup in it
    launcher.lags = {"rollout": 5, "reward": 0, "trainer": 0}
    line = launcher._line()
    assert line.startswith("\\[t]")  # the title is shown, not taken for console markup
    assert "dead letters: reward_error 1 (KeyError: \\[x] not found)" in line  # escaped for the console
    assert "stalled: reward (1 dead letters, nothing scored for 60 s)" in line
    out = io.StringIO()
    Console(file=out, width=300).print(launcher._render())
    assert "reward_error 1 (KeyError: [x] not found)" in out.getvalue()
    assert "reward (1 dead letters, nothing scored for 60 s)" in out.getvalue()

    snap = {"trainer_version": 0, "stages": {}, "workers": {}, "dlq": {"reward_error": 192},
            "dlq_first_error": {"reward_error": "ZeroDivisionError: division by zero"}, "stale_dropped": 0,
            "rollout_loaded_versions": {}}  # fmt: skip
    out = io.StringIO()
    Console(file=out, width=300).print(render_status(snap))
    assert "reward_error: 192 (ZeroDivisionError: division by zero)" in out.getvalue()


BOOM = '''"""A reward function with a bug."""


def reward(traj: dict) -> float:
    return 1 / 0
'''


MESSAGE = "ZeroDivisionError: division by zero (in reward 'boom:reward')"


@pytest.mark.kafka
@pytest.mark.slow
def test_a_job_whose_reward_raises_stops_non_zero_and_says_why(cli_env, tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "boom.py").write_text(BOOM)
    text = (REPO / "examples" / "next-digit.toml").read_text()
    good = 'tasks = { next_digit = [{ name = "exact_match", kwargs = { extract_regex = "^(.)" } }] }'
    assert good in text
    text = text.replace(good, 'tasks = { next_digit = [{ name = "boom:reward" }] }')
    assert 'name = "next-digit"' in text
    text = text.replace('name = "next-digit"', 'name = "boom-job"')
    text = text.replace("rollout_workers = 2", "rollout_workers = 1").replace(
        "reward_workers = 2", "reward_workers = 1"
    )
    (job_dir / "boom-job.toml").write_text(text)
    env = {**cli_env, "COLUMNS": "250"}
    t0 = time.monotonic()
    proc = subprocess.Popen([*rlstream_cmd(), "run", str(job_dir / "boom-job.toml"), "--no-live",
                             "--set", "liveness.stall_s=20"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    heard: list[tuple[float, str]] = []  # (seconds since the start, stderr line)
    reader = threading.Thread(target=lambda: heard.extend((time.monotonic() - t0, x) for x in proc.stderr))
    reader.start()
    try:
        out = proc.stdout.read()  # until the run exits (the stall stop, or whatever ends it)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()  # (only on a failure: the run ends by itself)
            proc.wait(60)
        reader.join(60)
    took = time.monotonic() - t0
    said = out + "".join(x for _, x in heard)
    assert code != 0, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    lines = [(t, x.rstrip()) for t, x in heard if x.startswith("stalled: no step for")]
    assert len(lines) == 1, said[-3000:]
    said_at, line = lines[0]
    assert "reward_error: ZeroDivisionError: division by zero (in reward 'boom:reward')" in line, line
    assert line.endswith("stopping the job"), line
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / "boom-job"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"].startswith("failed: stalled: no step for"), report["status"]
    assert report["steps_completed"] == 0
    assert report["dead_letters"]["reward/reward_error"]["first_error"] == MESSAGE
    print(f"\n[stall] rlstream run said {line!r} {said_at:.0f} s after it started; exit {code} after "
          f"{took:.0f} s (liveness.stall_s = 20)")  # fmt: skip

    config = str(run_dir / "config.toml")
    status = subprocess.run([*rlstream_cmd(), "-c", config, "status", "--interval", "0.2"], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert status.returncode == 0, status.stderr[-3000:]
    assert "reward_error: " in status.stdout and f"({MESSAGE})" in status.stdout, status.stdout
    snap = subprocess.run([*rlstream_cmd(), "-c", config, "status", "--json", "--interval", "0.2"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    got = json.loads(snap.stdout)
    assert got["dlq"]["reward_error"] == report["dead_letters"]["reward/reward_error"]["count"] > 0
    assert got["dlq_first_error"]["reward_error"] == MESSAGE
