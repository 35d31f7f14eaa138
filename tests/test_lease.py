"""The job lease (rlstream.lease) on a real broker: of two claims the earliest wins whatever order
they decide in; a dead launcher of this host frees the job at once, one of another host after its
ttl by the broker's clock, a live one never; a reused pid holds nothing; a run whose job was taken
over is told; one run dir is locked locally too. The CLI runs are in test_job_lease.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from pipeline.errors import JobAlreadyRunning
from pipeline.kafka import TIMESTAMP_LOG_APPEND_TIME, Producer, client_conf
from rlstream.lease import SCHEMA, JobLease, ensure_lease_topic, host_id, process_started
from tests.rollout_helpers import read_topic

pytestmark = pytest.mark.kafka


def states(cfg) -> list[tuple[str, str]]:
    return [(r["run_id"], r["state"]) for _, r in read_topic(cfg, "lease", SCHEMA)]


def forge(cfg, *, pid: int, host: str, hid: str, ttl_ms: int = 30_000, started: str = "", run_id: str = "f" * 32,
          roles: list[str] | None = None):  # fmt: skip
    """A ``held`` record of a launcher that is not this test's."""
    rec = {"run_id": run_id, "state": "held", "job": "j", "pid": pid, "pid_started": started, "host": host,
           "host_id": hid, "role_pids": roles or [], "run_dir": "/elsewhere", "started_at_ms": 1_700_000_000_000,
           "written_at_ms": int(time.time() * 1000), "ttl_ms": ttl_ms}  # fmt: skip
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        p.produce_record(cfg.topics.name("lease"), SCHEMA, rec, key=run_id.encode(), partition=0)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    return proc.pid


def test_of_two_claims_the_earliest_wins_whichever_decides_first(make_config, tmp_path):
    cfg = make_config("job.name=j")
    first, second = JobLease(cfg, tmp_path / "a"), JobLease(cfg, tmp_path / "b")  # two run dirs: Kafka decides
    try:
        assert first.claim() < second.claim()
        with pytest.raises(JobAlreadyRunning) as refused:
            second.decide()  # before the first has decided: its claim alone, earlier and live, wins
        first.decide()
        text = str(refused.value)
        assert text.startswith("job 'j' is already running: ") and "\n" not in text
        assert f"pid {os.getpid()} on host {socket.gethostname()} since " in text and first.run_id[:12] in text
        with pytest.raises(JobAlreadyRunning, match="already running"):
            JobLease(cfg, tmp_path / "c").acquire()  # a third, while the first holds it
    finally:
        second.release()
        first.release()
    with JobLease(cfg, tmp_path / "d") as after:  # released: free at once
        assert after.lost is None
    log = states(cfg)
    stamps = {m.timestamp()[0] for m, _ in read_topic(cfg, "lease", SCHEMA)}
    assert stamps == {TIMESTAMP_LOG_APPEND_TIME}  # the broker's clock, whoever wrote them
    mine = [s for r, s in log if r == first.run_id]
    assert mine[:2] == ["claim", "held"] and mine.count("released") == 1
    assert [s for r, s in log if r == second.run_id] == ["claim", "refused"]


def test_a_dead_launcher_here_frees_the_job_at_once_another_hosts_after_its_ttl_a_live_one_never(make_config, tmp_path):
    cfg = make_config("lease.ttl_s=30")
    ensure_lease_topic(cfg)
    with Producer(client_conf(cfg, "test", kind="producer")) as p:  # a foreign record is skipped, not fatal
        p.produce(cfg.topics.name("lease"), b"\x00garbage", partition=0)
    here, hid = socket.gethostname(), host_id()
    assert hid, "this test needs /proc"

    forge(cfg, pid=dead_pid(), host=here, hid=hid, run_id="1" * 32)  # kill -9ed on this host, just now
    JobLease(cfg, tmp_path).acquire().release()

    forge(cfg, pid=os.getpid(), host=here, hid=hid, started="1", run_id="2" * 32)  # a reused pid
    JobLease(cfg, tmp_path).acquire().release()

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        forge(cfg, pid=sleeper.pid, host=here, hid=hid, ttl_ms=1, started=process_started(sleeper.pid), run_id="3" * 32)
        time.sleep(0.1)  # its ttl is long past: only the live pid holds the job
        held = rf"pid {sleeper.pid} on host {re.escape(here)} .*kill {sleeper.pid}"
        with pytest.raises(JobAlreadyRunning, match=held):
            JobLease(cfg, tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait(60)
    JobLease(cfg, tmp_path).acquire().release()

    forge(cfg, pid=4242, host="elsewhere", hid="other", ttl_ms=8000, run_id="4" * 32)  # alive there, maybe
    with pytest.raises(JobAlreadyRunning, match=r"pid 4242 on host elsewhere .*wait \d s if it crashed"):
        JobLease(cfg, tmp_path).acquire()
    deadline = time.monotonic() + 120  # its ttl runs out by the broker's clock
    while True:
        try:
            JobLease(cfg, tmp_path).acquire().release()
            break
        except JobAlreadyRunning:
            assert time.monotonic() < deadline, "the other host's lease never expired"
            time.sleep(0.5)


def test_a_run_killed_here_is_taken_over_once_its_roles_have_stopped(make_config, tmp_path):
    """kill -9 of a launcher: its roles get SIGTERM and take a while to stop; a re-run holds the job
    at once but starts nothing before they are gone."""
    cfg = make_config()
    ensure_lease_topic(cfg)
    role = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a role still stopping
    rec = f"{role.pid}:{process_started(role.pid)}"
    forge(cfg, pid=dead_pid(), host=socket.gethostname(), hid=host_id(), roles=[rec], run_id="6" * 32)
    said = []

    def stop_once_waited_for():
        deadline = time.monotonic() + 120
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        role.terminate()

    threading.Thread(target=stop_once_waited_for, daemon=True).start()
    try:
        with JobLease(cfg, tmp_path, say=said.append) as lease:
            assert role.poll() is not None, "the lease did not wait for the killed run's role"
            assert lease.lost is None and said and f"pids {role.pid}" in said[0], said
    finally:
        role.kill()
        role.wait(60)


def test_a_run_whose_job_was_taken_over_is_told(make_config, tmp_path):
    cfg = make_config("lease.ttl_s=1.2")  # heartbeats every 0.2 s
    lease = JobLease(cfg, tmp_path).acquire()
    try:
        guard = lease.guard(lambda: None)
        assert guard() is None
        forge(cfg, pid=4242, host="elsewhere", hid="other", run_id="5" * 32)  # it found this run dead and won
        deadline = time.monotonic() + 60
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert guard().startswith("failed: lost the job lease to pid 4242 on host elsewhere")
    finally:
        lease.release()


def test_one_run_dir_is_locked_locally_whatever_the_topics(make_config, tmp_path):
    a = make_config("job.name=x")
    b = make_config("job.name=x", f"topics.prefix=t{uuid.uuid4().hex[:10]}.")
    with JobLease(a, tmp_path):
        refused = rf"job 'x' is already running: pid {os.getpid()} on host .*, run dir {re.escape(str(tmp_path))}\)"
        with pytest.raises(JobAlreadyRunning, match=refused):
            JobLease(b, tmp_path).acquire()
    JobLease(b, tmp_path).acquire().release()  # and free once the holder released it
