"""`rlstream run JOB.toml`: the example job files load and validate; a job killed mid-way (its
launcher SIGKILLed) and run again with the same command resumes, and the audit from the topics and
the trainer's steps log finds no sample lost or trained twice; TensorBoard files are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.ports import pid_alive
from tests.conftest import REPO, rlstream_cmd

EXAMPLES = sorted((REPO / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_job_loads_and_validates(path, tmp_path, monkeypatch):
    from rlstream.job import resolve

    for k in [k for k in os.environ if k.startswith("RLSTREAM_")]:
        monkeypatch.delenv(k)
    cfg = resolve(path, [f"run_dir={tmp_path}"], bootstrap="127.0.0.1:1")
    assert cfg.job.name and cfg.topics.prefix == f"{cfg.job.name}." and cfg.run_dir == tmp_path / cfg.job.name
    assert cfg.reward.group_id == f"{cfg.job.name}-reward" and cfg.trainer.group_id == f"{cfg.job.name}-trainer"
    assert cfg.feed.source is not None
    if cfg.job.dataset is not None:
        assert Path(cfg.feed.source).is_file() and Path(cfg.feed.source).read_text().strip()
    if cfg.job.eval:
        assert cfg.eval.source is not None
    text = path.read_text()
    assert text.startswith("#") and "Time:" in text  # each example says what it shows and how long it takes


def test_a_job_needs_a_name_and_a_known_generator(tmp_path):
    from pipeline.errors import ConfigError
    from rlstream.job import resolve

    (tmp_path / "bad.toml").write_text('[job]\ndataset = { generator = "nope" }\n')
    with pytest.raises(ConfigError, match="generator"):
        resolve(tmp_path / "bad.toml", [f"run_dir={tmp_path}"], bootstrap="x:1")


def test_arithmetic_both_forms_holds_out_word_forms_of_trained_sums(tmp_path):
    from rlstream.job import resolve
    from rlstream.tasks import arithmetic

    one = arithmetic()
    assert len(one) == 55 and len({r["id"].rstrip("w") for r in one}) == 55  # each sum once, one form
    (tmp_path / "a.toml").write_text(
        '[job]\nname = "a"\neval = true\n'
        'dataset = { generator = "arithmetic", held_out = 0.2, options = { forms = "both" } }\n'
    )
    cfg = resolve(tmp_path / "a.toml", [f"run_dir={tmp_path}"], bootstrap="x:1")
    read = lambda p: [json.loads(x) for x in Path(p).read_text().splitlines()]  # noqa: E731
    train, held = read(cfg.feed.source), read(cfg.eval.source)
    assert len(train) + len(held) == 110 and len(held) == 22
    assert all(r["id"].endswith("w") and " plus " in r["prompt"] for r in held)
    trained = {r["id"] for r in train}
    assert all(r["id"][:-1] in trained and r["id"] not in trained for r in held)  # the digit twin is trained
    with pytest.raises(ValueError, match="forms"):
        arithmetic(forms="all")


def _steps(run_dir: Path) -> list[dict]:
    from consumers.trainer.state import read_steps_log

    return read_steps_log(run_dir / "trainer")


@pytest.mark.kafka
@pytest.mark.slow
def test_a_killed_job_resumes_with_nothing_lost_or_trained_twice(cli_env, tmp_path):
    from rlstream.dev import chaos_audit
    from rlstream.job import resolve

    # The feed's rate (16 groups/s, 2 steps/s) keeps the first run from finishing before the kill:
    # unpaced, this job trains a step in 60-100 ms and once did all 16 between two polls (CI).
    steps, groups_per_step = 24, 8
    args = [*rlstream_cmd(), "run", str(REPO / "examples/next-digit.toml"), "--steps", str(steps), "--no-live",
            "--set", f"feed.limit={steps * groups_per_step}", "--set", "rollout.max_inflight=32",
            "--set", "feed.rate=16"]  # fmt: skip
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / "next-digit"
    first = subprocess.Popen(args, env=cli_env, stdout=open(tmp_path / "run1.out", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while len(_steps(run_dir)) < 3 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "run1.out").read_text()[-3000:]
        assert len(_steps(run_dir)) >= 3, "the job never got going"
    finally:
        first.send_signal(signal.SIGKILL)  # the whole run dies with its launcher
        first.wait(60)
    events = [json.loads(x) for x in (run_dir / "logs" / "events.jsonl").read_text().splitlines() if x.strip()]
    # the roles were forked from the fork server (job.fork_server, on by default), which dies with them
    starts = [e for e in events if e["event"] == "start"]
    assert starts and all(e.get("forked") for e in starts), starts
    assert [e["event"] for e in events].count("fork_server") == 1
    pids = {e["pid"] for e in events if e.get("pid")}
    deadline = time.monotonic() + 90
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids), "roles outlived their killed launcher"
    done_before = len(_steps(run_dir))
    assert done_before < steps

    second = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == steps
    pauses = report["longest_pause_s"]  # each stage's, from its workers' metrics
    assert {"trainer", "reward", "rollout"} <= set(pauses), pauses

    # Audited from the topics and the steps log, not from the roles' reports.
    same = [
        f"feed.limit={steps * groups_per_step}",
        f"topics.prefix={cli_env['RLSTREAM_TOPICS__PREFIX']}",
        f"run_dir={cli_env['RLSTREAM_RUN_DIR']}",
    ]  # what the runs got from their environment
    cfg = resolve(REPO / "examples/next-digit.toml", same, bootstrap=cli_env["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"])
    topics = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "scored")}
    a = chaos_audit.audit(chaos_audit.read_topics(cfg), _steps(run_dir), [], topics=topics, feed=cfg.feed.name,
                          expected_groups=steps * groups_per_step, k=cfg.rl.max_staleness)  # fmt: skip
    assert a["steps"] == steps and a["fed_groups"] == steps * groups_per_step
    assert a["lost_groups"] == 0 and a["trained_twice"] == 0 and a["stalled_groups"] == 0, a
    assert a["scored_twice"] == 0 and a["staleness_violations"] == 0, a

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    trained = {e.step: e.value for e in ea.Scalars("trainer/step_samples")}
    assert set(trained) == set(range(1, steps + 1))
    # a step whose samples were all stale (possible after the kill) has no reward point, not 0.0
    assert {e.step for e in ea.Scalars("trainer/reward_mean")} == {s for s, n in trained.items() if n > 0}


def test_metrics_ports_keep_their_layout_and_never_collide_whatever_the_worker_counts():
    from rlstream.launcher import metrics_port

    assert [metrics_port(9100, r, 0, 2, 2) for r in ("rollout", "reward", "trainer", "eval")] == [
        9100,
        9110,
        9120,
        9130,
    ]
    assert metrics_port(0, "trainer", 0, 2, 2) == 0
    for rollouts, rewards in ((10, 10), (11, 2), (3, 40), (256, 256)):
        ports = [metrics_port(9000, "rollout", i, rollouts, rewards) for i in range(rollouts)]
        ports += [metrics_port(9000, "reward", i, rollouts, rewards) for i in range(rewards)]
        ports += [metrics_port(9000, r, 0, rollouts, rewards) for r in ("trainer", "eval")]
        assert len(set(ports)) == len(ports), (rollouts, rewards)


def test_a_metrics_port_base_whose_ports_pass_65535_is_refused():
    from rlstream.config import JobConfig

    JobConfig(metrics_port_base=65000, rollout_workers=2)
    with pytest.raises(ValueError, match="65535"):
        JobConfig(metrics_port_base=65000, rollout_workers=200)
