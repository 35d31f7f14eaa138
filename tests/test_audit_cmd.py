"""``rlstream audit JOB``, through the real CLI and a real broker: a finished next-digit job audits
clean (one line, exit 0; by its job file or by its name; ``--json``), then a copy of one of its
scored records, produced in a committed transaction, makes the audit fail naming it (exit 1); a job
that never ran, or a missing job file, is one line and a non-zero exit. The in-flight reading of
the checks (a group still waiting at its stage is in flight, not lost) is shown on data built here."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from tests.conftest import CLUSTER_TOPICS, REPO, env_vars, run_cli

JOB = REPO / "examples/next-digit.toml"
STEPS = 3
FAST = ["rollout.max_inflight=32", "reward.session_timeout_ms=6000", "rollout.session_timeout_ms=6000"]


def _sets(*items: str) -> list[str]:
    return [x for s in items for x in ("--set", s)]


@pytest.fixture(scope="module")
def job(kafka_bootstrap, tmp_path_factory):
    """A finished STEPS-step next-digit job under its own name: (environment, name)."""
    base = tmp_path_factory.mktemp("audit")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(
        RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        RLSTREAM_RUN_DIR=str(base / "runs"),
        RLSTREAM_HOME=str(base / "home"),
        PYTHONUNBUFFERED="1",
        **env_vars(CLUSTER_TOPICS),
    )
    name = f"au{uuid.uuid4().hex[:8]}"
    run_cli(["run", str(JOB), "--steps", str(STEPS), "--no-live", *_sets(*FAST, f"job.name={name}")], env,
            timeout=900)  # fmt: skip
    return env, name


def audit(env, *args: str) -> subprocess.CompletedProcess:
    return run_cli(["audit", *args], env, timeout=300, check=False)


def _duplicate_one_scored_record(env, name: str) -> None:
    """Produce a copy of one committed rl.scored record, in a committed transaction."""
    from pipeline.kafka import Consumer, Producer, client_conf
    from rlstream.job import plan

    cfg = plan(JOB, [f"job.name={name}"], bootstrap=env["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"])[0]
    topic = cfg.topics.name("scored")
    with Consumer(client_conf(cfg, "test", kind="consumer")) as c:
        m = c.read_to_end(topic, timeout=120)[0]
    p = Producer(client_conf(cfg, "test", kind="producer"), transactional_id=f"test-dup-{uuid.uuid4().hex[:8]}")
    p.init_transactions()
    p.begin_transaction()
    p.produce(topic, m.value(), key=m.key(), partition=m.partition())
    p.commit_transaction()
    p.close()


@pytest.mark.kafka
@pytest.mark.slow
def test_a_clean_job_passes_and_a_record_scored_twice_fails(job):
    env, name = job
    by_file = audit(env, str(JOB), "--set", f"job.name={name}")
    assert by_file.returncode == 0, by_file.stdout + by_file.stderr
    lines = by_file.stdout.strip().splitlines()
    print(lines[0])
    assert len(lines) == 1 and lines[0].startswith(f"audit {name}: PASS (stopped)"), by_file.stdout
    assert f"steps={STEPS}" in lines[0] and "lost=0" in lines[0] and "scored_twice=0" in lines[0]

    by_name = audit(env, name, "--json", "--bootstrap", env["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"])
    assert by_name.returncode == 0, by_name.stdout + by_name.stderr
    report = json.loads(by_name.stdout)
    a = report["audit"]
    assert report["verdict"] == "PASS" and not report["failed"] and not report["running"]
    assert a["steps"] == STEPS and a["fed_groups"] > 0 and a["samples_used"] > 0
    assert a["lost_groups"] == 0 and a["trained_twice"] == 0 and a["staleness_violations"] == 0, a

    _duplicate_one_scored_record(env, name)
    dup = audit(env, name)
    assert dup.returncode == 1, dup.stdout + dup.stderr
    print(dup.stdout)
    assert "FAIL" in dup.stdout and "scored_twice=1" in dup.stdout and "rollouts scored twice: 1" in dup.stdout


@pytest.mark.kafka
def test_a_job_that_never_ran_or_a_missing_file_is_one_line_and_a_nonzero_exit(kafka_bootstrap, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap, RLSTREAM_HOME=str(tmp_path / "home"),
               RLSTREAM_RUN_DIR=str(tmp_path / "runs"))  # fmt: skip
    for args, says in (([f"never{uuid.uuid4().hex[:6]}"], "has it run?"), ([str(tmp_path / "no.toml")], "no job file")):
        t0 = time.monotonic()
        proc = audit(env, *args)
        assert proc.returncode == 2 and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert time.monotonic() - t0 < 60 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_group_waiting_at_its_stage_is_in_flight_and_one_read_past_is_lost():
    """Pure checks: group 0 fully trained; group 1's two samples scored but in no step; where the
    trainer's committed offset is still before them they are in flight, past them they are lost."""
    from rlstream.audit import audit as check
    from rlstream.audit import summary

    topics = {"prompts": "j.prompts", "rollouts": "j.rollouts", "scored": "j.scored"}
    data = {"prompts": [], "rollouts": [], "scored": [], "dlq": []}
    for g in range(2):
        data["prompts"].append({"p": 0, "o": g, "group_seq": g, "group_id": f"g{g}", "group_size": 2, "feed": "f"})
        for i in range(2):
            o = 2 * g + i
            data["rollouts"].append({"p": 0, "o": o, "tid": f"g{g}/{i}", "gid": f"g{g}", "size": 2})
            data["scored"].append({"p": 0, "o": o, "tid": f"g{g}/{i}", "gid": f"g{g}", "version_min": 0,
                                   "versions": None, "src": (0, o)})  # fmt: skip
    steps = [{"step": 1, "version": 0, "used": ["g0/0", "g0/1"], "stale": [], "incomplete_dropped": [],
              "groups": ["g0"], "loss": 0.1, "grad_norm": 1.0}]  # fmt: skip
    kw = {"topics": topics, "feed": "f", "expected_groups": 2, "k": 1}
    waiting = {("j.prompts", 0): 2, ("j.rollouts", 0): 4, ("j.scored", 0): 2}
    a = check(data, steps, [], **kw, read_upto=waiting, in_flight_from=waiting)
    assert a["in_flight_groups"] == 1 and a["lost_groups"] == 0 and a["stalled_groups"] == 0, a
    assert summary("j", a)["verdict"] == "PASS"
    read_past = {**waiting, ("j.scored", 0): 4}
    a = check(data, steps, [], **kw, read_upto=read_past, in_flight_from=read_past)
    assert a["in_flight_groups"] == 0 and a["lost_groups"] == 1 and a["stalled_groups"] == 1, a
    s = summary("j", a)
    assert s["verdict"] == "FAIL" and "fed groups lost: 1" in s["line"]
    a = check(data, steps, [], **kw)  # a drained run (rlstream chaos): nothing is in flight
    assert a["lost_groups"] == 1 and a["in_flight_groups"] == 0
    # an undecodable record read past by its stage, and not in rl.dlq
    bad = [{"topic": "rollouts", "kind": "undecodable", "partition": 0, "offset": 3}]
    a = check(data, steps, bad, **kw, read_upto=waiting, in_flight_from=waiting)
    assert a["dlq_missing"] == 1 and "bad records not in the dead-letter topic" in summary("j", a)["line"]
