"""The Python API (``from rlstream import Job``): ``import rlstream`` stays light; a job built in
code is checked at once; against the real broker a tiny job built in code runs, shows its status,
exports an HF directory, resumes from its checkpoint when run again with more steps, and evaluates
its newest version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter

import pytest

from rlstream.demo import CHARSET
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def no_rlstream_env(monkeypatch):
    """The job's settings are the test's own, whatever the shell running the tests exports."""
    for k in [k for k in os.environ if k.startswith("RLSTREAM_") and k not in ("RLSTREAM_HOME", "RLSTREAM_CACHE")]:
        monkeypatch.delenv(k)


def test_import_rlstream_loads_no_heavy_library_and_job_is_there():
    code = (
        "import sys, rlstream\n"
        "heavy = ('torch', 'transformers', 'confluent_kafka')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "from rlstream import Job\n"
        "import rlstream.api\n"
        "assert Job is rlstream.api.Job and 'Job' in rlstream.__all__\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "try:\n    rlstream.nope\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "[]", "module 'rlstream' has no attribute 'nope'"], out.stdout


def test_a_job_in_code_is_checked_when_it_is_made(tmp_path):
    from pipeline.errors import ConfigError
    from rlstream import Job

    with pytest.raises(ConfigError, match=r"trainer\.nope: unknown key"):
        Job(config={"trainer": {"nope": 1}, "run_dir": str(tmp_path)}, name="x")
    with pytest.raises(ConfigError, match="needs a name"):
        Job(config={"run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="not both"):
        Job(REPO / "examples/next-digit.toml", config={})
    with pytest.raises(ConfigError, match="config file not found"):
        Job(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="generator"):
        Job(config={"job": {"name": "g", "dataset": {"generator": "nope"}}, "run_dir": str(tmp_path)})

    # a file job and the same job in code resolve to the same places (so either resumes the other)
    from_file = Job(REPO / "examples/next-digit.toml", sets=[f"run_dir={tmp_path}"])
    in_code = Job(config={"run_dir": str(tmp_path), "job": {"dataset": {"generator": "next_digit"}}}, name="next-digit")
    for cfg in (from_file.config, in_code.config):
        assert cfg.topics.prefix == "next-digit." and cfg.trainer.group_id == "next-digit-trainer"
        assert cfg.feed.source == tmp_path / "next-digit/data/next_digit-train.jsonl"
    assert from_file.run_dir == in_code.run_dir == tmp_path / "next-digit" and in_code.report is None
    assert from_file.config.reward.import_dirs == [(REPO / "examples").resolve()]  # as `rlstream run` records


def test_run_raises_what_the_cli_exits_with(tmp_path, monkeypatch):
    """A failed run is JobFailed carrying the report; an interrupted one re-raises KeyboardInterrupt."""
    import rlstream.job
    from pipeline.errors import JobFailed
    from rlstream import Job

    job = Job(config={"run_dir": str(tmp_path), "kafka": {"bootstrap_servers": "127.0.0.1:1"}}, name="j")
    failed = {"status": "failed: trainer exited with code 1 (crash loop)", "steps_completed": 1, "steps_requested": 3}
    monkeypatch.setattr(rlstream.job, "launch", lambda cfg, *a, **kw: dict(failed))
    with pytest.raises(
        JobFailed, match=r"job j: failed: trainer exited with code 1 \(crash loop\) at step 1 of 3"
    ) as e:
        job.run(3)
    assert e.value.report == failed and job.config.trainer.max_steps == 3
    monkeypatch.setattr(rlstream.job, "launch", lambda cfg, *a, **kw: {"status": "interrupted"})
    with pytest.raises(KeyboardInterrupt):
        job.run()
    for bad in (0, -1, 2.5, True):
        with pytest.raises(Exception, match="positive whole number"):
            job.run(bad)


def tiny_job(bootstrap: str, run_dir) -> dict:
    """A job in code: the next-digit task (2 of its 10 prompts held out), a 1-layer tiny model,
    one worker per role, 2 groups of 4 per step."""
    return {
        "job": {
            "rollout_workers": 1,
            "reward_workers": 1,
            "dataset": {"generator": "next_digit", "held_out": 0.2},
        },
        "kafka": {"bootstrap_servers": bootstrap},
        "run_dir": str(run_dir),
        "topics": {"prompts": {"partitions": 2}, "rollouts": {"partitions": 2}, "scored": {"partitions": 1}},
        "rl": {"max_staleness": 1, "group_size": 4, "groups_per_step": 2},
        "model": {
            "type": "tiny",
            "charset": CHARSET,
            "hidden_size": 32,
            "num_heads": 2,
            "num_layers": 1,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        },
        "feed": {"epochs": 100000, "shuffle_seed": 0},
        "rollout": {"max_inflight": 16, "max_new_tokens": 2, "temperature": 1.0},
        "reward": {
            "executor": "thread",
            "pool_size": 1,
            "max_batch_ms": 50,
            "metrics_interval_s": 2,
            "tasks": {"next_digit": [{"name": "exact_match", "kwargs": {"extract_regex": "^(.)"}}]},
        },
        "trainer": {
            "lr": 0.003,
            "micro_batch_size": 64,
            "group_timeout_s": 60,
            "metrics_interval_s": 2,
            "keep_weight_versions": 10,
        },
        "eval": {"samples": 2, "max_new_tokens": 1},
    }


@pytest.mark.kafka
def test_a_job_in_code_runs_reports_exports_resumes_and_evaluates(kafka_bootstrap, tmp_path):
    from transformers import AutoModelForCausalLM

    from consumers.trainer.state import read_steps_log
    from pipeline.errors import UnknownVersion
    from rlstream import Job

    name = f"api-{uuid.uuid4().hex[:8]}"  # its own topics and consumer groups on the shared broker
    job = Job(config=tiny_job(kafka_bootstrap, tmp_path / "runs"), name=name)
    assert job.run_dir == tmp_path / "runs" / name and job.config.topics.prefix == f"{name}."

    first = job.run(steps=3, live=False)
    assert first["status"] == "ok" and first["steps_completed"] == 3 and first["job"] == name
    assert job.report == json.loads(json.dumps(first, default=str))  # the same report as report.json
    steps = read_steps_log(job.run_dir / "trainer")
    assert [s["step"] for s in steps] == [1, 2, 3]

    rows = job.samples(4)  # what the model wrote, read off the scored topic
    assert len(rows) == 4 and all({"prompt", "completion", "reward", "advantage", "staleness"} <= set(r) for r in rows)
    snap = job.status(interval=0.5)
    assert snap["trainer_version"] == 3 and snap["weight_updates"] == 3
    assert snap["stages"]["trainer"]["group"] == f"{name}-trainer" and snap["stages"]["trainer"]["lag"] >= 0

    out = job.export()  # the newest version, into the run dir
    assert out == job.run_dir / "export" / "v3"
    assert (out / "rlstream-version.txt").read_text().split()[0] == "3"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.num_hidden_layers == 1
    assert job.export(version=2, dest=tmp_path / "v2") == tmp_path / "v2"
    assert (tmp_path / "v2" / "rlstream-version.txt").read_text().split()[0] == "2"
    with pytest.raises(UnknownVersion, match=r"version 9 does not exist: the versions there are 1-3 \(newest 3\)"):
        job.export(version=9)

    again = Job(config=tiny_job(kafka_bootstrap, tmp_path / "runs"), name=name)  # a new kernel, the same job
    second = again.run(steps=5, live=False)
    assert second["status"] == "ok" and second["steps_completed"] == 5
    resumed = read_steps_log(job.run_dir / "trainer")
    assert [s["step"] for s in resumed] == [1, 2, 3, 4, 5] and resumed[:3] == steps  # from the checkpoint
    used = Counter(t for s in resumed for t in s["used"])
    assert used and max(used.values()) == 1, "a sample was trained twice"

    result = again.eval()  # the newest version, on the 2 held-out prompts
    assert result["version"] == 5 and result["eval_answers"] == 4 and 0.0 <= result["eval_pass_at_1"] <= 1.0
    assert len((job.run_dir / "eval" / "v5.jsonl").read_text().splitlines()) == 4

    child = again.fork(f"{name}-f", from_version=3)  # rlstream run --fork, from code
    assert child.name == f"{name}-f" and child.config.topics.prefix == f"{name}-f." and child.report is None
    forked = child.run(steps=1, live=False)
    assert forked["status"] == "ok" and forked["forked_from"]["job"] == name and forked["forked_from"]["version"] == 3
    child.remove()
    assert not child.run_dir.exists()


def test_a_job_keeps_the_local_broker_it_started_until_it_is_closed(tmp_path):
    """No broker configured: the first call that needs Kafka starts the local broker, the next calls
    use the same one, and ``close()`` (the end of the ``with`` block) stops it."""
    from rlstream import Job
    from rlstream.broker_cluster import local_broker
    from rlstream.config import BrokerConfig

    broker_cfg = {"data_dir": str(tmp_path / "broker"), "port": 0, "heap_mb": 384}
    broker = local_broker(BrokerConfig(**broker_cfg))
    with Job(config={"run_dir": str(tmp_path / "runs"), "broker": broker_cfg}, name="kept") as job:
        job.remove()  # nothing of the job there yet: it says so
        first = broker.state()
        assert first is not None and first["pid"]
        job.remove()
        assert broker.state()["pid"] == first["pid"]  # the same broker, not a new one per call
    assert broker.state() is None
