"""``rlstream samples`` and the sample tables, through the real CLI and a real broker, on one short
next-digit job shared by the module: the command prints each sample's prompt, completion, reward,
group advantage, versions and staleness (newest, of a version, worst, best, as JSON); ``--follow``
shows a sample within 2 s of its scoring and stops cleanly on SIGTERM; a job that has not run, or
no broker, is one line and a non-zero exit within seconds; the tracking role's TensorBoard event
files hold the ``samples/train`` and ``samples/eval`` text tables, and W&B (offline, where
``wandb`` is installed) the same as Tables."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_TOPICS, REPO, env_vars, rlstream_cmd

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
JOB = REPO / "examples/next-digit.toml"
STEPS, ROWS = 10, 6
HAS_WANDB = importlib.util.find_spec("wandb") is not None
SETS = [
    "rollout.max_inflight=32",
    "tracking.samples_every=5",
    f"tracking.samples_rows={ROWS}",
    "job.eval=true",
    "job.dataset.held_out=0.2",
    "eval.every_versions=5",
    "eval.max_prompts=8",
    *(["tracking.wandb_project=rlstream-test"] if HAS_WANDB else []),
]


def _args(*sets: str) -> list[str]:
    return [x for s in (*SETS, *sets) for x in ("--set", s)]


@pytest.fixture(scope="module")
def job(kafka_bootstrap, tmp_path_factory):
    """A finished STEPS-step run of the next-digit job: (environment, run dir)."""
    tmp = tmp_path_factory.mktemp("samples")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLSTREAM_", "WANDB_"))}
    env.update(
        RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        RLSTREAM_TOPICS__PREFIX=f"t{uuid.uuid4().hex[:10]}.",
        RLSTREAM_RUN_DIR=str(tmp / "runs"),
        RLSTREAM_HOME=str(tmp / "home"),
        PYTHONUNBUFFERED="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        **env_vars(CLUSTER_TOPICS),
    )
    run = subprocess.run([*rlstream_cmd(), "run", str(JOB), "--steps", str(STEPS), "--no-live", *_args()], env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return env, Path(env["RLSTREAM_RUN_DIR"]) / "next-digit"


def samples(env, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*rlstream_cmd(), "samples", str(JOB), *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def rows_of(proc) -> list[dict]:
    return [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]


def test_samples_show_prompts_completions_rewards_advantages_versions_and_staleness(job):
    env, _ = job
    text = samples(env, "--n", "3").stdout
    assert len(re.findall(r"^v\d+(-\d+)?  staleness \d+  reward [01]\.000  advantage ", text, re.M)) == 3, text
    assert len(re.findall(r"^  prompt: +\d>$", text, re.M)) == 3, text
    assert text.count("  completion:") == 3, text

    rows = rows_of(samples(env, "--n", "24", "--json"))
    assert len(rows) == 24
    newest = {r["staleness"] + r["version_min"] for r in rows}
    assert newest == {STEPS}, "staleness is the newest published version minus the sample's oldest version"
    assert all(r["version_min"] <= r["version_max"] <= STEPS for r in rows)
    assert [r["scored_at_ms"] for r in rows] == sorted(r["scored_at_ms"] for r in rows), "oldest first"
    for r in rows:
        assert re.fullmatch(r"\d>", r["prompt"]) and r["reward"] in (0.0, 1.0), r
        expected = str((int(r["prompt"][0]) + 1) % 10)  # the next-digit task: exact match of the first character
        assert r["reward"] == float(r["completion"][:1] == expected), r
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert any(r["advantage"] is not None for r in rows)
    for g in groups.values():
        if all(r["advantage"] is not None for r in g) and len(g) == g[0]["group_size"]:
            assert abs(sum(r["advantage"] for r in g)) < 1e-6  # GRPO: centred on the group's mean
            mean = sum(r["reward"] for r in g) / len(g)
            assert all((r["advantage"] > 0) == (r["reward"] > mean) for r in g if r["reward"] != mean)

    v2 = rows_of(samples(env, "--version", "2", "--n", "5", "--json"))
    assert v2 and all(r["version_min"] <= 2 <= r["version_max"] for r in v2)
    worst = [r["reward"] for r in rows_of(samples(env, "--worst", "--n", "5", "--json"))]
    best = [r["reward"] for r in rows_of(samples(env, "--best", "--n", "5", "--json"))]
    assert worst == sorted(worst) and best == sorted(best, reverse=True) and len(best) == 5
    assert worst[0] == 0.0 and best[0] == 1.0


def test_a_job_that_has_not_run_or_no_broker_is_one_line_and_a_nonzero_exit(job):
    env, _ = job
    for sets, says in (
        (["--set", "topics.prefix=nosuchjob."], "no topic nosuchjob.scored"),
        (["--set", "kafka.bootstrap_servers=127.0.0.1:1", "--set", "liveness.broker_check_s=2"], "BrokerUnreachable"),
    ):
        t0 = time.monotonic()
        proc = samples(env, *sets, check=False)
        assert proc.returncode != 0 and time.monotonic() - t0 < 30
        out = (proc.stdout + proc.stderr).strip()
        assert says in out and len(out.splitlines()) == 1, out
    proc = subprocess.run(
        [*rlstream_cmd(), "samples", "nosuch.toml"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "no job file nosuch.toml" in proc.stdout + proc.stderr


def _md_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines()[2:]]


def test_tensorboard_holds_the_sample_tables(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = job
    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    assert {"samples/train", "samples/eval"} <= set(ea.Tags()["tensors"])
    train = ea.Tensors("samples/train")
    assert {e.step for e in train} == {5, 10}
    table = train[-1].tensor_proto.string_val[0].decode()
    assert table.splitlines()[0] == "| version | reward | advantage | prompt | completion |"
    rows = _md_rows(table)
    assert len(rows) == ROWS and all(re.fullmatch(r"\d>", r[3]) and r[1] in ("0", "1") for r in rows), table
    evals = {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors("samples/eval")}
    assert 0 in evals and STEPS in evals, evals.keys()  # version 0 and the final version
    assert evals[0].splitlines()[0] == "| version | reward | prompt | completion | reference |"
    assert [r[2] for r in _md_rows(evals[0])] == [r[2] for r in _md_rows(evals[STEPS])]  # the same prompts


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline_run_holds_the_sample_tables(job):
    _, run_dir = job
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    media = run / "files" / "media" / "table" / "samples"
    train = [json.loads(p.read_text()) for p in media.glob("train_*.table.json")]
    evals = [json.loads(p.read_text()) for p in media.glob("eval_*.table.json")]
    assert train and evals
    assert train[0]["columns"] == ["version", "reward", "advantage", "prompt", "completion"]
    assert all(len(t["data"]) == ROWS and all(re.fullmatch(r"\d>", row[3]) for row in t["data"]) for t in train)
    assert evals[0]["columns"] == ["version", "reward", "prompt", "completion", "reference"]


def test_follow_shows_each_sample_within_2_s_of_its_scoring_and_stops_on_sigterm(job):
    env, _ = job
    started = time.time()
    follower = subprocess.Popen([*rlstream_cmd(), "samples", str(JOB), "--follow", "--json", "--n", "0"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen: list[tuple[float, dict]] = []
    ready = threading.Event()

    def read_out():
        for line in follower.stdout:
            seen.append((time.time(), json.loads(line)))

    def read_err():
        for line in follower.stderr:
            if line.startswith("following "):
                ready.set()

    threads = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for t in threads:
        t.start()
    try:
        assert ready.wait(60), "the follower never started"
        more = STEPS + 4
        run = subprocess.run([*rlstream_cmd(), "run", str(JOB), "--steps", str(more), "--no-live", *_args()], env=env,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        deadline = time.monotonic() + 30
        while not any(r["version_min"] >= more - 1 for _, r in seen) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        follower.send_signal(signal.SIGTERM)
        rc = follower.wait(20)
    assert rc == 0
    assert len(seen) >= 64, len(seen)  # at least a step's samples
    assert all(r["scored_at_ms"] / 1000 >= started for _, r in seen), "only samples scored after it started"
    lat = sorted(at - r["scored_at_ms"] / 1000 for at, r in seen)
    none = sum(r["advantage"] is None for _, r in seen)
    print(
        f"follow: {len(lat)} shown, median {statistics.median(lat):.3f} s, max {lat[-1]:.3f} s, {none} without advantage"
    )
    assert statistics.median(lat) < 2.0 and lat[int(0.9 * len(lat))] < 2.0, lat
