"""A busy step is not a stall, and no Kafka client line reaches the terminal.

The trainer says where it is inside a long step (``consumers.trainer.heartbeat``); ``StallWatch``
counts that as progress and the launcher shows it as ``trainer: busy in step N for S s (...)``.
Folded from synthetic records first (no Kafka, no sleeps); then real jobs through the real CLI on
the real broker: one whose train engine sleeps 30 s per step with the stall threshold at 10 s
(``liveness.stall_s = 20``), one short run whose terminal must hold no librdkafka line."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.conftest import REPO, rlstream_cmd

T0 = 1_000_000.0


def event(role: str, t: float, labels: dict | None = None, **metrics) -> dict:
    return {"role": role, "worker_id": f"{role}-0", "version": 0, "timestamp_ms": int(t * 1000),
            "metrics": {k: float(v) for k, v in metrics.items()}, "labels": labels or {}}  # fmt: skip


def busy(t: float, step: int, since: float, phase: str = "forward-backward", mb: int = 3, n: int = 8) -> dict:
    return event("trainer", t, {"phase": phase}, busy_step=step, busy_since_ms=since * 1000, micro_batch=mb,
                 micro_batches=n, minibatch=1, minibatches=1)  # fmt: skip


LAGS = {"rollout": 30, "reward": 0, "trainer": 64}  # samples wait for the trainer


def test_a_trainer_that_says_it_is_inside_its_first_step_is_busy_not_stalled():
    from rlstream.stall import StallWatch

    w = StallWatch(T0, stall_s=300)  # named after 60 s
    for t in range(5, 90, 5):  # the first step: 85 s and counting, an event every 5 s
        w.add_metric(busy(T0 + t, 1, T0 + 2, mb=min(8, t // 10 + 1)))
    assert w.stalled(T0 + 90, LAGS) == []
    assert w.busy(T0 + 90) == "busy in step 1 for 88 s (forward-backward, micro-batch 8/8)"
    w.add_metric(event("trainer", T0 + 95, step=1, reward_mean=0.5))  # the step is done
    assert w.busy(T0 + 96) is None
    w.add_metric(busy(T0 + 94, 1, T0 + 2))  # the step's last in-step event, read after the step
    assert w.busy(T0 + 96) is None


def test_a_trainer_that_says_nothing_is_named_and_one_that_stops_saying_is_too():
    from rlstream.stall import StallWatch

    w = StallWatch(T0, stall_s=300)
    assert w.stalled(T0 + 59, LAGS) == []
    assert w.stalled(T0 + 61, LAGS) == ["trainer (lag 64, no step for 61 s)"]  # no event at all
    assert w.busy(T0 + 61) is None

    w = StallWatch(T0, stall_s=300)
    w.add_metric(busy(T0 + 10, 1, T0 + 5, phase="checkpoint", mb=0, n=0))
    assert w.busy(T0 + 20) == "busy in step 1 for 15 s (checkpoint)"
    assert w.stalled(T0 + 69, LAGS) == []
    assert w.busy(T0 + 71) is None  # its events stopped 61 s ago
    assert w.stalled(T0 + 71, LAGS) == ["trainer (lag 64, no step for 71 s)"]


def test_a_busy_trainer_is_not_stopped_for_dead_letters_upstream_and_the_views_say_busy(tmp_path):
    import io

    from rich.console import Console

    from rlstream.config import load_config
    from rlstream.launcher import Launcher, standard_roles
    from rlstream.stall import StallWatch

    w = StallWatch(T0, stall_s=20)
    w.add_dead_letter({"error_type": "reward_error", "reason": "ValueError: x", "role": "reward",
                       "worker_id": "reward-0", "failed_at_ms": int((T0 + 3) * 1000)})  # fmt: skip
    w.add_metric(busy(T0 + 25, 1, T0 + 1))
    assert w.verdict(T0 + 30) is None  # busy inside its step
    assert w.verdict(T0 + 40) is not None  # no event for 15 s (> 10 s) and no step for 40 s

    cfg = load_config(None, [f"run_dir={tmp_path}"], environ={})
    launcher = Launcher(cfg, tmp_path, standard_roles(cfg, 1, 1), title="t", live=False, console=Console())
    now = time.time()
    launcher.stall = StallWatch(now - 100, cfg.liveness.stall_s)
    launcher.stall.add_metric(busy(now - 1, 1, now - 80, phase="forward-backward"))
    launcher.lags = dict(LAGS)
    line = launcher._line()
    assert "trainer: busy in step 1 for 80 s (forward-backward, micro-batch 3/8)" in line
    assert "stalled" not in line
    out = io.StringIO()
    Console(file=out, width=300).print(launcher._render())
    assert "busy in step 1 for 80 s (forward-backward, micro-batch 3/8)" in out.getvalue()

    from rlstream.status import render as render_status

    snap = {"trainer_version": 0, "stages": {}, "workers": {}, "dlq": {}, "stale_dropped": 0,
            "rollout_loaded_versions": {}, "trainer_busy": "busy in step 4 for 95 s (optimizer)"}  # fmt: skip
    out = io.StringIO()
    Console(file=out, width=300).print(render_status(snap))
    assert "busy in step 4 for 95 s (optimizer)" in out.getvalue()


RDKAFKA_LINE = re.compile(r"%\d+\|\d|\|rdkafka#|GETPID|FAIL\|rdkafka|librdkafka")


def small_job(tmp_path, name: str):
    text = (REPO / "examples" / "next-digit.toml").read_text()
    assert 'name = "next-digit"' in text
    text = text.replace('name = "next-digit"', f'name = "{name}"')
    text = text.replace("rollout_workers = 2", "rollout_workers = 1").replace(
        "reward_workers = 2", "reward_workers = 1"
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def run_job(cli_env, args: list[str], timeout: float) -> tuple[int, str]:
    proc = subprocess.run([*rlstream_cmd(), "run", *args], env={**cli_env, "COLUMNS": "250"}, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.kafka
@pytest.mark.slow
def test_a_job_with_long_steps_is_said_busy_never_stalled(cli_env, tmp_path):
    job = small_job(tmp_path, "sleepy")
    code, said = run_job(cli_env, [str(job), "--no-live", "--steps", "2",
                                   "--set", "liveness.stall_s=20",  # names a stall after 10 s
                                   "--set", 'trainer.engine={type = "tests.sleepy_engine:SleepyEngine", options = {sleep_s = 30}}',
                                   "--set", "trainer.micro_batch_size=16"], timeout=600)  # fmt: skip
    assert code == 0, said[-4000:]
    assert "stalled" not in said, said[-4000:]
    busy_lines = [x for x in said.splitlines() if "trainer: busy in step" in x]
    assert busy_lines, said[-4000:]
    assert any(re.search(r"busy in step 1 for \d+ s \((forward-backward|optimizer), micro-batch \d/4\)", x)
               for x in busy_lines), busy_lines  # fmt: skip
    assert not [x for x in said.splitlines() if RDKAFKA_LINE.search(x)], said[-4000:]


@pytest.mark.kafka
@pytest.mark.slow
def test_no_kafka_client_line_reaches_the_terminal(cli_env, tmp_path):
    job = small_job(tmp_path, "quiet")
    code, said = run_job(cli_env, [str(job), "--no-live", "--steps", "3"], timeout=400)
    assert code == 0, said[-4000:]
    noise = [x for x in said.splitlines() if RDKAFKA_LINE.search(x)]
    assert not noise, noise
