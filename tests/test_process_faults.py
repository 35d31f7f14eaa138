"""Process faults beyond kill -9, with the real CLI against a real broker: a reward worker stopped
(SIGSTOP) inside a transaction for longer than its session timeout wakes as a zombie that cannot
commit, says so, and carries on, while its batch is scored exactly once by the other worker; a role
killed by the kernel's OOM killer (a cgroup memory limit, or RLIMIT_AS where no cgroup can be had)
is said in one line and restarted, and the job's data stays whole."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline import codec
from rlstream.audit import audit, read_topics
from tests.conftest import rlstream_cmd
from tests.test_reward_worker import produce, traj

SESSION_MS = 6000
"""The reward group's session timeout in these tests (the broker's least, by default)."""


def wait_until(cond, timeout: float, what: str, procs=()) -> None:
    """Wait for ``cond()`` (polled), failing with ``what`` after ``timeout`` s or when one of
    ``procs`` (name -> (Popen, log path)) exits meanwhile."""
    deadline = time.monotonic() + timeout
    while not cond():
        for name, (p, path) in dict(procs).items():
            assert p.poll() is None, f"{name} exited {p.returncode}:\n{Path(path).read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def start_reward(name: str, env: dict, tmp_path: Path, *sets: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.log"
    args = [x for s in (f"reward.worker_id={name}", *sets) for x in ("--set", s)]
    with open(log, "ab") as out:
        proc = subprocess.Popen([*rlstream_cmd(), "reward", *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def scored_sources(cfg) -> list[tuple[int, int]]:
    from pipeline.kafka import Consumer, client_conf

    with Consumer(client_conf(cfg, "test", kind="consumer")) as c:
        msgs = c.read_to_end(cfg.topics.name("scored"), timeout=60)
    return [
        (r["source_partition"], r["source_offset"])
        for r in (codec.decode_as(m.value(), "ScoredTrajectory") for m in msgs)
    ]


def committed_all(cfg, ends: dict[int, int]) -> bool:
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    admin = Admin(client_conf(cfg, "test"), 30)
    try:
        got = admin.committed(cfg.reward.group_id, cfg.topics.name("rollouts"), len(ends))
    finally:
        admin.close()
    return all(got.get(p, -1) >= end for p, end in ends.items())


def exactly_once(cfg, expected: set[tuple[int, int]]) -> dict:
    """The audit of rl.scored: every rollout scored once (``scored_twice`` 0), none missing."""
    data = read_topics(cfg, timeout=120)
    names = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "scored")}
    a = audit(data, [], [], topics=names, feed="", expected_groups=0, k=cfg.rl.max_staleness)
    sources = [tuple(row["src"]) for row in data["scored"] if not row.get("bad")]
    a["missing"] = sorted(expected - set(sources))
    return a


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("past", ["session", "transaction"])
def test_a_reward_worker_stopped_past_its_timeouts_cannot_commit_its_batch(past, make_config, cli_env, tmp_path):
    """Worker A is SIGSTOPped inside a transaction (records produced, offsets not yet sent) and kept
    stopped past the session timeout (``past="transaction"``: past its transaction timeout too, so
    the broker aborts that transaction and fences A's producer epoch): the group gives A's
    partitions to B, which scores A's batch. SIGCONT: A cannot commit and says so; past the session
    timeout it aborts and carries on, past the transaction timeout it exits for a restart (started
    again here, as the supervisor would). A's watchdog limit is shorter than the stop: the time it
    stood still is not taken for a hang. Every rollout is scored exactly once, and the rollouts
    written afterwards too."""
    common = ["reward.executor=thread", f"reward.session_timeout_ms={SESSION_MS}", "reward.heartbeat_interval_ms=500"]
    txn_ms = 8000 if past == "transaction" else 60_000
    victim = [*common, "reward.chaos_delay_in_txn_ms=4000", f"reward.transaction_timeout_ms={txn_ms}",
              "liveness.watchdog_s=8", "log_level=DEBUG"]  # fmt: skip
    cfg = make_config(*common)
    parts = cfg.topics.rollouts.partitions
    a = start_reward("w-a", cli_env, tmp_path, *victim)
    b = start_reward("w-b", cli_env, tmp_path, *common)
    procs = {"w-a": a, "w-b": b}
    try:
        wait_until(lambda: all("partitions assigned" in p[1].read_text() for p in procs.values()), 300,
                   "both workers in the group", procs)  # fmt: skip
        items = [(f"g{i}".encode(), codec.encode("Trajectory", traj(i, "abc", f"g{i}"))) for i in range(4 * parts)]
        for p in range(parts):
            produce(cfg, items[p * 4 : p * 4 + 4], partition=p)
        expected = {(p, o) for p in range(parts) for o in range(4)}
        wait_until(lambda: "transaction open" in a[1].read_text(), 120, "worker A inside a transaction", procs)
        os.kill(a[0].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        least = (txn_ms / 1000 + 15) if past == "transaction" else 2 * SESSION_MS / 1000  # (+ the broker's
        try:  # 5 s sweep of timed-out transactions, and a margin)
            wait_until(lambda: committed_all(cfg, {p: 4 for p in range(parts)}), 180,
                       "worker B to score A's batch too", {"w-b": b})  # fmt: skip
            time.sleep(max(0.0, least - (time.monotonic() - stopped_at)))  # the fault is this long
        finally:
            os.kill(a[0].pid, signal.SIGCONT)
        wait_until(lambda: "could not commit" in a[1].read_text(), 120, "worker A to say it cannot commit")
        wait_until(lambda: "was stopped for" in a[1].read_text(), 60, "A's watchdog to see the stop (not a hang)")
        if past == "transaction":  # fenced: it exits for a restart, saying why
            assert a[0].wait(60) not in (0, 75), a[1].read_text()[-4000:]
            assert "stayed open past reward.transaction_timeout_ms" in a[1].read_text()
            procs["w-a"] = a = start_reward("w-a", cli_env, tmp_path, *victim)  # the supervisor's restart
        wait_until(lambda: a[1].read_text().split("could not commit")[-1].count("partitions assigned") >= 1, 300,
                   "worker A back in the group", procs)  # fmt: skip
        more = [(f"h{i}".encode(), codec.encode("Trajectory", traj(i, "abc", f"h{i}"))) for i in range(4 * parts)]
        for p in range(parts):
            produce(cfg, more[p * 4 : p * 4 + 4], partition=p)
        expected |= {(p, o) for p in range(parts) for o in range(4, 8)}
        wait_until(lambda: committed_all(cfg, {p: 8 for p in range(parts)}), 180, "the second round scored", procs)
        found = exactly_once(cfg, expected)
        assert found["scored_twice"] == 0, found["scored_twice_examples"]
        assert found["missing"] == [] and found["order_violations"] == 0, found
        for p, _ in procs.values():
            p.send_signal(signal.SIGTERM)
        for name, (p, path) in procs.items():
            assert p.wait(60) == 0, f"{name}:\n{path.read_text()[-3000:]}"
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)


# ---- OOM kills -------------------------------------------------------------------------------
GREEDY = """
import os, sys, time
mark = sys.argv[1]
if not os.path.exists(mark):  # the first run takes 1 MB pages until the limit stops it
    open(mark, "w").close()
    hoard = []
    for _ in range(2000):
        hoard.append(bytearray(1024 * 1024))
    print("survived", flush=True)
    sys.exit(3)
print("second run: within the limit", flush=True)
"""


def greedy(traj: dict) -> float:
    """A reward that, the first time it scores (no marker file at ``OOM_TEST_MARK``),
    takes 1 MB pages until its process is killed for it; afterwards it scores 1.0."""
    mark = os.environ["OOM_TEST_MARK"]
    if not os.path.exists(mark):
        Path(mark).touch()
        hoard = [bytearray(1024 * 1024) for _ in range(4000)]
        return float(len(hoard))
    return 1.0


def exits(sup, name: str, timeout: float) -> list[dict]:
    """Wait (``sup.check()`` polled) until ``name`` finished or was restarted; its exit events."""
    deadline = time.monotonic() + timeout
    while True:
        finished = sup.check()
        if name in finished or any(e["event"] == "restart" and e["name"] == name for e in sup.events):
            return [e for e in sup.events if e["event"] == "exit" and e["name"] == name]
        assert time.monotonic() < deadline, f"{name}: no exit within {timeout} s: {sup.events}"
        time.sleep(0.2)


@pytest.mark.parametrize("kind", ["cgroup", "rlimit"])
def test_a_child_over_its_memory_limit_is_said_and_restarted(kind, tmp_path, caplog, monkeypatch):
    """A child that takes more memory than its limit is killed by the kernel's OOM killer (a
    memory cgroup) or dies of a MemoryError (RLIMIT_AS, where no cgroup can be had); the supervisor
    says so in one line, records the exit as ``oom`` and restarts it (under the same limit)."""
    import sys

    from rlstream import memory_limit
    from rlstream.supervisor import RestartPolicy, Supervisor

    if kind == "rlimit":
        monkeypatch.setattr(memory_limit, "_make_cgroup", lambda *a: None)
    argv = [sys.executable, "-c", GREEDY, str(tmp_path / "mark")]
    with Supervisor(tmp_path / "logs", restart=RestartPolicy(backoff_s=0.2)) as sup:
        with caplog.at_level("WARNING", logger="rlstream"):
            sup.start("greedy-0", argv, may_exit=True, memory_limit_mb=200)
            limit = sup.children["greedy-0"].memory
            if kind == "cgroup" and limit.kind == "rlimit":
                pytest.skip(f"no memory cgroup on this machine ({limit.why_not_cgroup})")
            assert limit.kind.startswith(kind)
            died = exits(sup, "greedy-0", 120)
            assert wait_finished(sup, "greedy-0", 120)
    assert [e["cause"] for e in died][:1] == ["oom"], died
    if kind == "cgroup":
        assert died[0]["code"] == -9
        said = "greedy-0 was killed by the kernel's OOM killer (memory limit 200 MB); restarting"
    else:
        said = "greedy-0 ran out of memory (memory limit 200 MB, RLIMIT_AS: MemoryError); restarting"
    assert any(r.getMessage().startswith(said) for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert "second run: within the limit" in (tmp_path / "logs" / "greedy-0.log").read_text()
    assert limit.path is None or not limit.path.exists()  # the role's cgroup is gone with it


def wait_finished(sup, name: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if name in sup.check():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.kafka
@pytest.mark.slow
def test_a_reward_worker_killed_by_the_oom_killer_is_restarted_and_scores_exactly_once(
    make_config, cli_env, tmp_path, caplog
):
    """``rlstream reward`` run by the supervisor under a 300 MB memory limit: its reward function
    takes 4 GB on the first rollout it scores, the kernel kills the worker (or, without a cgroup,
    it dies of a MemoryError), the supervisor says so in one line and restarts it, and the restart
    scores every rollout exactly once: the batch the dead worker held was never committed."""
    from rlstream.supervisor import RestartPolicy, Supervisor

    sets = ["reward.executor=thread", 'reward.default=[{name="tests.test_process_faults:greedy"}]',
            f"reward.session_timeout_ms={SESSION_MS}"]  # the dead member's partitions wait this long  # fmt: skip
    cfg = make_config(*sets)
    parts = cfg.topics.rollouts.partitions
    items = [(f"g{i}".encode(), codec.encode("Trajectory", traj(i, "abc", f"g{i}"))) for i in range(2 * parts)]
    for p in range(parts):
        produce(cfg, items[p * 2 : p * 2 + 2], partition=p)
    env = {**cli_env, "OOM_TEST_MARK": str(tmp_path / "mark")}
    args = ["reward", *(x for s in [*sets, "reward.worker_id=r0"] for x in ("--set", s))]
    with Supervisor(tmp_path / "logs", env, RestartPolicy(backoff_s=0.5)) as sup:
        with caplog.at_level("WARNING", logger="rlstream"):
            sup.start("reward-0", args, memory_limit_mb=300)
            kind = sup.children["reward-0"].memory.kind
            died = exits(sup, "reward-0", 300)
            assert died and died[0]["cause"] == "oom", died
            wait_until(lambda: sup.check() == [] and committed_all(cfg, {p: 2 for p in range(parts)}), 300,
                       "the restarted worker to score everything")  # fmt: skip
    said = [
        r.getMessage()
        for r in caplog.records
        if "reward-0 " in r.getMessage() and "memory limit 300 MB" in r.getMessage()
    ]
    assert said and said[0].split(" code=")[0].endswith("; restarting"), (kind, said)
    found = exactly_once(cfg, {(p, o) for p in range(parts) for o in range(2)})
    assert found["scored_twice"] == 0 and found["missing"] == [], found


# ---- the chaos fault class -------------------------------------------------------------------
def _ctx(cfg, sup, said: list[str]):
    from types import SimpleNamespace

    return SimpleNamespace(cfg=cfg, launcher=SimpleNamespace(sup=sup), run_dir=None, broker_ops=None,
                           say=said.append, rng=None)  # fmt: skip


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_process_fault_class_stops_and_continues_a_role_and_plans_its_faults(tmp_path):
    """``stop``: the role is stopped (state T) for its seconds, then continued; ``plan`` gives every
    other stop past the role's session timeout, and the OOM faults."""
    import random
    import sys

    from rlstream.config import load_config
    from rlstream.dev.chaos_plan import Fault
    from rlstream.dev.chaos_process import ProcessFaults
    from rlstream.supervisor import RestartPolicy, Supervisor

    cfg = load_config(None, ["reward.session_timeout_ms=6000"], environ={})
    said: list[str] = []
    with Supervisor(tmp_path / "logs", restart=RestartPolicy(backoff_s=0.2)) as sup:
        sup.start("reward-0", [sys.executable, "-c", "import time; time.sleep(600)"])
        pf = ProcessFaults(_ctx(cfg, sup, said))
        plan = pf.plan({"stops": 4, "ooms": 2}, random.Random(1), 100.0)
        stops = [f for f in plan if f.kind == "stop"]
        assert len(stops) == 4 and sum(1 for f in plan if f.kind == "oom") == 2
        assert sum(1 for f in stops if f.arg > pf.session_s(f.target)) == 2
        f = Fault(0.0, "stop", "reward-0", arg=1.0)
        assert pf.do(f, 0.0).startswith("SIGSTOP reward-0") and pf.busy
        pid = sup.children["reward-0"].proc.pid
        wait_until(lambda: _state(pid) == "T", 30, "the role stopped")  # signals arrive asynchronously
        assert pf.do(Fault(0.0, "stop", "reward-0", arg=1.0), 0.1) is None  # one fault at a time per role
        pf.poll(0.5)
        assert pf.busy and _state(pid) == "T"
        pf.poll(1.2)
        assert not pf.busy and f.outcome.startswith("SIGCONT reward-0")
        wait_until(lambda: _state(pid) in "RS", 30, "the role continued")
        assert pf.done[0]["kind"] == "stop" and pf.done[0]["seconds"] == 1.2
        pf.do(Fault(2.0, "stop", "reward-0", arg=60.0), 2.0)
        wait_until(lambda: _state(pid) == "T", 30, "the role stopped again")
        pf.close()  # the harness exits: nothing is left stopped
        wait_until(lambda: _state(pid) in "RS", 30, "the role continued")
        assert not pf.busy


def test_the_process_fault_class_has_a_role_killed_for_memory(tmp_path):
    """``oom``: the role is stopped and restarted under a memory limit below what it takes to
    start; the kernel kills it, the supervisor says so and restarts it without the limit, and the
    fault records what was seen."""
    import sys

    from rlstream.config import load_config
    from rlstream.dev.chaos_plan import Fault
    from rlstream.dev.chaos_process import ProcessFaults
    from rlstream.supervisor import RestartPolicy, Supervisor

    grows = "import time\nhoard = [bytearray(1 << 20) for _ in range(200)]\ntime.sleep(600)\n"
    said: list[str] = []
    with Supervisor(tmp_path / "logs", restart=RestartPolicy(backoff_s=0.2)) as sup:
        sup.start("reward-0", [sys.executable, "-c", grows])
        pf = ProcessFaults(_ctx(load_config(None, [], environ={}), sup, said))
        f = Fault(0.0, "oom", "reward-0", arg=64)
        line = pf.do(f, 0.0)
        assert line.startswith("SIGTERM reward-0") and "memory limit of 64 MB" in line, line
        t0 = time.monotonic()
        while pf.busy:
            sup.check()
            pf.poll(time.monotonic() - t0)
            assert time.monotonic() - t0 < 120, sup.events
            time.sleep(0.2)
        assert "OOM killer" in f.outcome or "ran out of memory" in f.outcome, f.outcome
        causes = [e["cause"] for e in sup.events if e["event"] == "exit"]
        assert causes == ["injected: chaos oom: restarted under a memory limit", "oom"], sup.events
        wait_until(lambda: sup.check() == [] and sup.alive("reward-0"), 60, "the restart")
        assert sup.children["reward-0"].memory.pid is None  # the restart runs without the limit
        assert pf.done[0]["kind"] == "oom" and any("OOM killer" in s for s in pf.done[0]["seen"]), pf.done
        assert len([e for e in sup.events if e["event"] == "restart"]) == 2


@pytest.mark.kafka
@pytest.mark.slow
def test_process_faults_on_supervised_reward_workers_keep_scoring_exactly_once(make_config, cli_env, tmp_path):
    """The chaos fault class on two supervised ``rlstream reward`` workers while rollouts keep
    coming: reward-0 stopped past its session timeout, then reward-1 restarted under a memory limit
    it cannot start in (the kernel kills it; the supervisor says so and restarts it without the
    limit). Every rollout is scored exactly once."""
    import threading

    from rlstream.dev.chaos_plan import Fault
    from rlstream.dev.chaos_process import OOM_LIMIT_MB, ProcessFaults
    from rlstream.supervisor import RestartPolicy, Supervisor

    sets = ["reward.executor=thread", f"reward.session_timeout_ms={SESSION_MS}", "reward.heartbeat_interval_ms=500"]
    cfg = make_config(*sets)
    parts = cfg.topics.rollouts.partitions
    sent: list[int] = []
    done = threading.Event()

    def feed():  # ~10 rollouts a second over every partition until told to stop
        i = 0
        while not done.is_set():
            produce(cfg, [(f"f{i}".encode(), codec.encode("Trajectory", traj(i, "abc", f"f{i}")))], partition=i % parts)
            sent.append(i)
            i += 1
            time.sleep(0.1)

    said: list[str] = []
    with Supervisor(tmp_path / "logs", cli_env, RestartPolicy(backoff_s=0.5)) as sup:
        for n in ("reward-0", "reward-1"):
            sup.start(n, ["reward", *(x for s in [*sets, f"reward.worker_id={n}"] for x in ("--set", s))])
        logs = {n: tmp_path / "logs" / f"{n}.log" for n in ("reward-0", "reward-1")}
        wait_until(lambda: sup.check() == [] and all("partitions assigned" in p.read_text() for p in logs.values()),
                   300, "both workers in the group")  # fmt: skip
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        pf = ProcessFaults(_ctx(cfg, sup, said))
        t0 = time.monotonic()
        faults = [
            Fault(2.0, "stop", "reward-0", arg=SESSION_MS / 1000 + 9),
            Fault(25.0, "oom", "reward-1", arg=OOM_LIMIT_MB),
        ]
        try:
            while faults or pf.busy:
                t = time.monotonic() - t0
                sup.check()
                for f in [f for f in faults if f.at <= t]:
                    if pf.do(f, t) is not None:
                        faults.remove(f)
                pf.poll(t)
                assert t < 300, (said, sup.events[-5:])
                time.sleep(0.2)
        finally:
            pf.close()
            done.set()
            feeder.join(30)
        ends = {p: len([i for i in sent if i % parts == p]) for p in range(parts)}
        wait_until(lambda: sup.check() == [] and committed_all(cfg, ends), 300, "every rollout scored")
    stop, oom = pf.done
    assert any("was stopped for" in s for s in stop["seen"]), stop
    assert oom["kind"] == "oom" and any("memory limit" in s for s in oom["seen"]), (oom, said)
    found = exactly_once(cfg, {(p, o) for p in range(parts) for o in range(ends[p])})
    assert found["scored_twice"] == 0 and found["missing"] == [], found
