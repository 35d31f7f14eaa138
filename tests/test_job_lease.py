"""One run per job, through the real CLI (``rlstream run``) on a real broker: a second launch of a
running job is refused in one line naming the running launcher, writes nothing into its run dir,
and does not damage it (the first finishes ok and its audit is clean); a launcher killed with
``kill -9`` (its process group) leaves the job free to resume at once on the same host."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, rlstream_cmd
from tests.rollout_helpers import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
JOB = REPO / "examples/next-digit.toml"
GROUPS_PER_STEP = 8


def job_args(steps: int, rate: float) -> list[str]:
    return [*rlstream_cmd(), "run", str(JOB), "--steps", str(steps), "--no-live",
            "--set", f"feed.limit={steps * GROUPS_PER_STEP}", "--set", f"feed.rate={rate}",
            "--set", "rollout.max_inflight=32"]  # fmt: skip


def steps_done(run_dir: Path) -> int:
    from consumers.trainer.state import read_steps_log

    return len(read_steps_log(run_dir / "trainer"))


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, out: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < n and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, out.read_text()[-3000:]
    assert steps_done(run_dir) >= n, "the job never got going"


@pytest.fixture
def job_env(cli_env, topic_prefix) -> dict[str, str]:
    """``cli_env`` with a job name of the test's own: its consumer groups and transactional ids
    (``<name>-<role>``) are then the test's own too, on a broker shared with other runs of the job."""
    return {**cli_env, "RLSTREAM_JOB__NAME": f"nd-{topic_prefix.rstrip('.')}"}


def job_config(cli_env, steps: int):
    from rlstream.job import resolve

    same = [
        f"job.name={cli_env['RLSTREAM_JOB__NAME']}",
        f"feed.limit={steps * GROUPS_PER_STEP}",
        f"topics.prefix={cli_env['RLSTREAM_TOPICS__PREFIX']}",
        f"run_dir={cli_env['RLSTREAM_RUN_DIR']}",
    ]  # what the runs got from their environment
    return resolve(JOB, same, bootstrap=cli_env["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"])


def assert_clean_audit(cfg, run_dir: Path, steps: int) -> None:
    from consumers.trainer.state import read_steps_log
    from rlstream.dev import chaos_audit

    topics = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "scored")}
    a = chaos_audit.audit(chaos_audit.read_topics(cfg), read_steps_log(run_dir / "trainer"), [], topics=topics,
                          feed=cfg.feed.name, expected_groups=steps * GROUPS_PER_STEP, k=cfg.rl.max_staleness)  # fmt: skip
    assert a["steps"] == steps and a["fed_groups"] == steps * GROUPS_PER_STEP, a
    assert a["lost_groups"] == 0 and a["trained_twice"] == 0 and a["stalled_groups"] == 0, a
    assert a["scored_twice"] == 0 and a["staleness_violations"] == 0, a


def lease_log(cfg) -> dict[str, list[str]]:
    """Run id -> the states it wrote on the job's lease topic, in order."""
    out: dict[str, list[str]] = {}
    for _, r in read_topic(cfg, "lease", "JobLease"):
        out.setdefault(r["run_id"], []).append(r["state"])
    return out


@contextlib.contextmanager
def launched(args: list[str], env: dict, out: Path):
    """A launcher in its own process group; stopped (SIGTERM: it stops its roles) if still running."""
    proc = subprocess.Popen(args, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(60)


def refused_launch(env: dict, steps: int, rate: float) -> tuple[list[str], float, int]:
    """Launch the job again: its non-empty output lines, seconds to its exit, its exit code."""
    t0 = time.monotonic()
    proc = subprocess.run(job_args(steps, rate), env=env, capture_output=True, text=True, timeout=300)
    return [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()], time.monotonic() - t0, proc.returncode


def test_a_second_launch_of_a_running_job_is_refused_and_the_first_finishes_unharmed(job_env, tmp_path):
    cli_env, name = job_env, job_env["RLSTREAM_JOB__NAME"]
    steps, rate = 16, 3  # paced at 0.375 steps/s: the first run lives well past the second launches
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / name
    out1 = tmp_path / "run1.out"
    elsewhere = {**cli_env, "RLSTREAM_RUN_DIR": str(tmp_path / "elsewhere")}  # as from another machine's disk
    with launched(job_args(steps, rate), cli_env, out1) as first:
        wait_for_steps(run_dir, 1, first, out1)
        written = {p: p.stat().st_mtime_ns for p in (run_dir / "config.toml", run_dir / ".lease")}
        same_dir = refused_launch(cli_env, steps, rate)  # the local lock on the run dir refuses it
        same_topics = refused_launch(elsewhere, steps, rate)  # the lease in Kafka refuses it (read, not claimed)
        still_running = first.poll() is None
        for lines, elapsed, code in (same_dir, same_topics):
            assert code == 2 and len(lines) == 1, lines  # one line, no traceback
            assert lines[0].startswith(f"error: JobAlreadyRunning: job '{name}' is already running: "), lines
            assert f"pid {first.pid} on host {socket.gethostname()} since " in lines[0], lines
            assert elapsed < 60, f"refused only after {elapsed:.0f} s"
        assert still_running, "the first run ended before the others were refused: nothing was tested"
        # the refused launches wrote nothing (the report is the first run's: its run_id, below; it may
        # be written already, while the first run's process tears down, on a loaded machine: CI)
        assert {p: p.stat().st_mtime_ns for p in written} == written
        assert first.wait(900) == 0, out1.read_text()[-3000:]

    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == steps
    cfg = job_config(cli_env, steps)
    leases = lease_log(cfg)
    mine = leases.pop(report["run_id"])  # the report is the first run's
    assert mine[0] == "claim" and set(mine[1:-1]) == {"held"} and mine[-1] == "released", mine
    # neither refused launch claimed the job: one by the run dir's lock, the one from elsewhere by
    # reading the lease before anything (the job's record names another run dir: the running job is
    # said first); the claim protocol itself is tests/test_lease.py's
    assert list(leases.values()) == []
    assert_clean_audit(cfg, run_dir, steps)
    from rlstream.dev import chaos_audit

    prompts = chaos_audit.read_topics(cfg)["prompts"]
    assert len(prompts) == steps * GROUPS_PER_STEP  # no second feed ran: no prompt fed twice


def test_a_job_whose_launcher_was_killed_resumes_at_once_on_the_same_host(job_env, tmp_path):
    cli_env = job_env
    steps = 12
    run_dir = Path(cli_env["RLSTREAM_RUN_DIR"]) / cli_env["RLSTREAM_JOB__NAME"]
    out1 = tmp_path / "run1.out"
    with launched(job_args(steps, 8), cli_env, out1) as first:
        try:
            wait_for_steps(run_dir, 2, first, out1)
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # kill -9 of the launcher's process group (its roles: their own)
            first.wait(60)
    assert steps_done(run_dir) < steps
    # at once: its roles may still be stopping (SIGTERM from the kernel); the lease waits for them
    second = subprocess.run(job_args(steps, 8), env=cli_env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "already running" not in second.stdout + second.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == steps
    cfg = job_config(cli_env, steps)
    leases = lease_log(cfg)
    killed = [s for run, s in leases.items() if run != report["run_id"]]
    assert len(killed) == 1 and killed[0][:2] == ["claim", "held"] and "released" not in killed[0], leases
    assert leases[report["run_id"]][:2] == ["claim", "held"] and leases[report["run_id"]][-1] == "released"
    assert_clean_audit(cfg, run_dir, steps)
