"""Alive, or loudly dead: the worker lifecycle's watchdog, bounded shutdown and second signal; the
supervisor's restarts, crash-loop stop and children that die with it; and the everyday faults that
could stall or hang roles: a rebalance while prompts are held, a broker restart in
the middle of a transaction, a failing first weight load (dead-lettered, not fatal), and roles started before their topics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pipeline.ports import pid_alive
from rlstream.supervisor import ChildDied, CrashLoop, RestartPolicy, Supervisor
from tests.conftest import REPO, rlstream_cmd, run_cli

HANGING_WORKER = """
import sys, time
from pipeline.worker import Worker
from rlstream.config import load_config
cfg = load_config(None, sys.argv[2:], environ={{}})
class Role(Worker):
    role = "probe"
    def run_once(self):
        {body}
        return True
    def finish(self):
        {finish}
print("ready", flush=True)
Role(cfg).run()
print("clean exit", flush=True)
"""


def start_probe(body: str, finish: str = "pass", *sets: str) -> subprocess.Popen:
    code = textwrap.dedent(HANGING_WORKER).format(body=body, finish=finish)
    return subprocess.Popen(
        [sys.executable, "-c", code, "probe", *sets],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout.readline().strip() == "ready"


def test_watchdog_kills_a_hung_loop_with_every_stack_in_the_log():
    proc = start_probe("time.sleep(3600)", "pass", "liveness.watchdog_s=5")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    assert "is hung" in out and "no progress in main loop" in out
    assert "run_once" in out and "Thread" in out  # faulthandler's dump of every thread


def test_sigterm_finishes_and_exits_zero_a_second_signal_exits_at_once():
    proc = start_probe("time.sleep(0.05)")
    wait_ready(proc)
    time.sleep(1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "clean exit" in out, out
    assert time.monotonic() - t0 < 30

    proc = start_probe("time.sleep(0.05)", "time.sleep(3600)")  # a finish that never ends
    wait_ready(proc)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < 10


def test_a_stop_that_takes_too_long_is_cut_short_loudly():
    proc = start_probe("time.sleep(0.05)", "time.sleep(3600)", "liveness.shutdown_timeout_s=3")
    wait_ready(proc)
    time.sleep(1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75 and "asked to stop" in out, out
    assert time.monotonic() - t0 < 30


def test_a_stop_reaches_a_main_thread_stuck_in_a_native_call():
    """Python runs a signal handler only between the main thread's bytecodes: a main thread inside a
    long native call (here ~minutes of PBKDF2; seen: an emulated-bf16 training step on an AVX2 CPU,
    whose trainer outlived its killed launcher) never ran it. The watchdog learns of the signal
    itself (``signal.set_wakeup_fd``): the stop bound holds, and a second signal exits at once."""
    stuck = "import hashlib; hashlib.pbkdf2_hmac('sha256', b'x', b'y', 2**31 - 1)"
    for shutdown_s, signals, code, says in (
        (3, 1, 75, "asked to stop"),
        (3600, 2, 128 + signal.SIGTERM, "second SIGTERM"),
    ):
        proc = start_probe(stuck, "pass", f"liveness.shutdown_timeout_s={shutdown_s}", "liveness.watchdog_s=3600")
        try:
            wait_ready(proc)
            time.sleep(2)
            for _ in range(signals):
                proc.send_signal(signal.SIGTERM)
                time.sleep(1)
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()  # the old code never exits by itself: do not leave it computing
            proc.wait(30)
        assert proc.returncode == code and says in out, out


def test_supervisor_restarts_a_dead_child_and_stops_a_crash_loop(tmp_path):
    flag = tmp_path / "crashed-once"
    once = f"import pathlib, sys, time; p = pathlib.Path({str(flag)!r})\nif not p.exists(): p.touch(); sys.exit(3)\ntime.sleep(60)"
    policy = RestartPolicy(max_restarts=3, window_s=120, backoff_s=0.1, max_backoff_s=0.2)
    with Supervisor(tmp_path / "logs", restart=policy) as sup:
        sup.start("flaky", [sys.executable, "-c", once])
        sup.start("looper", [sys.executable, "-c", "import sys; sys.exit(4)"])
        deadline = time.monotonic() + 60
        with pytest.raises(CrashLoop) as ei:
            while time.monotonic() < deadline:
                sup.check()
                time.sleep(0.05)
        assert ei.value.name == "looper" and ei.value.code == 4 and "3 restarts" in str(ei.value)
        assert sup.restarts()["flaky"] == 1 and sup.alive("flaky")
    with Supervisor(tmp_path / "logs2") as sup:  # no policy: the first death is an error, as before
        sup.start("x", [sys.executable, "-c", "import sys; sys.exit(5)"]).proc.wait(30)
        with pytest.raises(ChildDied):
            sup.check()


def test_children_do_not_outlive_a_supervisor_killed_with_sigkill(tmp_path):
    parent = textwrap.dedent(
        f"""
        import sys, time
        from rlstream.supervisor import Supervisor
        sup = Supervisor({str(tmp_path)!r})
        c = sup.start("child", [sys.executable, "-c",
            "from pipeline.worker import die_with_parent; die_with_parent(); import time; time.sleep(300)"])
        print(c.proc.pid, flush=True)
        time.sleep(300)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    time.sleep(2)  # the child has asked for its parent-death signal
    assert pid_alive(child)
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 30
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = pid_alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived its supervisor"


def test_rlstream_cache_is_not_taken_for_a_config_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    p = run_cli(["config", "show"], {**env, "RLSTREAM_CACHE": str(tmp_path)})
    assert "[rl]" in p.stdout


# ---- everyday faults against a real broker ------------------------------------------------------
DATA = "tests/data/prompts.jsonl"
TINY = ["model.hidden_size=32", "model.num_heads=2", "model.num_layers=1", "model.intermediate_size=64"]


@pytest.mark.kafka
@pytest.mark.slow
def test_partitions_handed_back_while_prompts_are_held_are_fetched_again(make_config):
    """Worker A holds prompts for admission (k = 0; a queue of 4 samples, so a partition
    holding one message has its share and is paused); B joins and takes some of them, then leaves
    and hands them back. librdkafka keeps a partition's pause flag across revoke and re-assign:
    without the wrapper's resume-on-assign A never fetches them again and the groups on them are
    never generated."""
    from producers import feed
    from tests.rollout_helpers import publish_version
    from tests.test_rollout import WorkerThread, base_state, trajectories, wait_for

    common = ("rl.max_staleness=0", "rl.groups_per_step=2", "rl.group_size=2", "topics.prompts.partitions=4")
    kafka = 'kafka.consumer={"session.timeout.ms" = 6000, "heartbeat.interval.ms" = 500}'
    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=12", "rollout.max_new_tokens=4", "rollout.queue_samples=4", *common, kafka
    )
    feed.run(cfg)
    a = WorkerThread(cfg)
    wait_for(lambda: len(trajectories(cfg, 0, 0)) >= 4, what="v0's two groups", worker=a)
    wait_for(lambda: a.worker.consumer.paused(), what="A pausing partitions that hold prompts", worker=a)
    b = WorkerThread(cfg)
    wait_for(
        lambda: b.worker.consumer is not None and b.worker.consumer.assignment(), timeout=120, what="B joined", worker=b
    )
    b.join()  # B leaves: its partitions go back to A
    wait_for(lambda: len(a.worker.consumer.assignment()) == 4, timeout=120, what="A owning every partition", worker=a)
    for v in range(1, 6):  # versions follow each other (a gap is an implausible notice)
        publish_version(cfg, v, base_state(cfg))  # v5 admits every group
    got = wait_for(lambda: (t := trajectories(cfg, 24, 0)) and len({x["group_seq"] for x in t}) == 12 and t,
                   timeout=240, what="all 12 groups generated", worker=a)  # fmt: skip
    a.join()
    assert {t["group_seq"] for t in got} == set(range(12))


def test_sigterm_while_setup_waits_for_a_broker_that_is_down_exits_zero(tmp_path):
    """A worker asked to stop while its start-up retries an unreachable broker (a chaos 'leave'
    during a broker restart) stops at once and exits 0, instead of being cut short as hung. It runs
    as a supervised role (RLSTREAM_PARENT_PID): those wait for the broker instead of stopping after
    ``liveness.broker_check_s`` as a command run by hand does."""
    from pipeline.ports import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}", RLSTREAM_RUN_DIR=str(tmp_path / "runs"),
               RLSTREAM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", RLSTREAM_PARENT_PID=str(os.getpid()))  # fmt: skip
    log = tmp_path / "rollout.log"
    args = [*rlstream_cmd(), "rollout", *(x for s in [*TINY, "liveness.shutdown_timeout_s=60"] for x in ("--set", s))]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while "waiting for Kafka" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and "waiting for Kafka" in log.read_text(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert code == 0 and "SIGTERM during setup" in text and "stopped during setup" in text, text[-3000:]


@pytest.mark.kafka
def test_a_failing_first_weight_load_is_dead_lettered_and_the_worker_keeps_going(make_config, cli_env):
    """A checkpoint that does not match its sha256 no
    longer stops the worker (one bogus notice must not brick a job): it is tried a bounded number of times,
    dead-lettered on rl.dlq with its reason, and the worker keeps running on the weights it has;
    SIGTERM still stops it promptly, through its clean shutdown."""
    from pipeline.checkpoint import write_weights
    from pipeline.control import publish_weight_update
    from pipeline.kafka import Producer, client_conf
    from pipeline.models import load_model, materialize
    from tests.rollout_helpers import read_topic

    cfg = make_config(*(f"model.{s}" for s in ("type=tiny",)), *TINY)
    uri, _, nbytes = write_weights(cfg.store, 1, load_model(materialize(cfg.model)).state_dict())
    bad = {
        "version": 1,
        "uri": uri,
        "sha256": "0" * 64,
        "bytes": nbytes,
        "step": 1,
        "created_at_ms": 0,
        "trainer_id": "t",
    }
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        publish_weight_update(p, cfg.topics.name("control"), bad)
    sets = [x for s in TINY for x in ("--set", s)]
    proc = subprocess.Popen(
        [*rlstream_cmd(), "rollout", *sets], env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        dl = read_topic(cfg, "dlq", "DeadLetter", min_count=1, timeout=180)
        assert [d["error_type"] for _, d in dl] == ["unverifiable_checkpoint"], dl
        assert "ChecksumError" in dl[0][1]["reason"] and proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert "rollout worker stopped" in out and time.monotonic() - t0 < 60, out[-3000:]
        assert proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM), out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.kafka
@pytest.mark.slow
def test_roles_started_before_their_topics_wait_for_them(make_config, cli_env, tmp_path):
    """Metadata not ready / topics not created yet is transient at start-up: a reward
    worker and a trainer started first, then the topics, then data: the trainer trains its steps,
    and SIGTERM stops the reward worker cleanly within the bound."""
    from pipeline.admin import ensure_topics
    from pipeline.kafka import Producer, client_conf
    from tests.test_trainer import scored

    cfg = make_config("rl.group_size=2", "rl.groups_per_step=1", "model.type=tiny", *TINY, create=False)
    sets = [
        x for s in ("rl.group_size=2", "rl.groups_per_step=1", *TINY, "reward.executor=thread") for x in ("--set", s)
    ]
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ("reward", "train")}
    procs = {
        "reward": subprocess.Popen([*rlstream_cmd(), "reward", *sets], env=cli_env, stdout=logs["reward"], stderr=subprocess.STDOUT),
        "train": subprocess.Popen([*rlstream_cmd(), "train", "--max-steps", "2", *sets], env=cli_env,
                                  stdout=logs["train"], stderr=subprocess.STDOUT),
    }  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # both up and waiting (the topics do not exist yet): their
        while not all("waiting for" in (tmp_path / f"{n}.log").read_text() for n in procs):  # start-up
            assert all(p.poll() is None for p in procs.values()), (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the roles never said they were waiting for their topics"
            time.sleep(0.5)  # (imports) takes 5-60 s with the machine's load: waited on, not slept
        ensure_topics(cfg)
        with Producer(client_conf(cfg, "test", kind="producer")) as p:
            for g in range(2):
                for i in range(2):
                    t = scored(f"r{g}", i, 2, 0, 0.0, seq=g)["trajectory"]
                    t.update(reference='{"answer": "abc"}', response_text="abc" if i else "x", task="t")
                    p.produce_record(cfg.topics.name("rollouts"), "Trajectory", t, key=t["group_id"].encode())
        assert procs["train"].wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        t0 = time.monotonic()
        procs["reward"].send_signal(signal.SIGTERM)
        assert procs["reward"].wait(timeout=60) == 0, (tmp_path / "reward.log").read_text()[-3000:]
        assert time.monotonic() - t0 < 30
        assert "waiting for" in (tmp_path / "reward.log").read_text()  # it said what it was waiting for
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()


@pytest.mark.kafka
def test_a_reward_worker_stuck_in_a_transaction_is_declared_hung(make_config, cli_env, tmp_path):
    """The watchdog bounds the transaction: a worker blocked inside one past liveness.watchdog_s
    (here a fault-injection sleep; after a broker restart librdkafka can block the same way in
    send_offsets_to_transaction) dumps its stacks and exits 75 so a supervisor restarts it."""
    from pipeline import codec
    from tests.test_reward_worker import produce, traj

    cfg = make_config("reward.executor=thread")
    produce(cfg, [(b"g1", codec.encode("Trajectory", traj(0, "abc")))])
    sets = ["reward.executor=thread", "reward.chaos_delay_in_txn_ms=30000", "liveness.watchdog_s=5"]
    proc = run_cli(["reward", *(x for s in sets for x in ("--set", s))], cli_env, timeout=180, check=False)
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "is hung" in proc.stderr and "in transaction" in proc.stderr and "_txn_checkpoint" in proc.stderr


@pytest.mark.kafka
@pytest.mark.slow
def test_scoring_goes_on_through_a_broker_restart_exactly_once(tmp_path):
    """The broker is stopped for ~12 s while a reward worker (the real CLI, supervised as
    `rlstream demo` runs it) is inside transactions, then started again on the same data dir. The
    worker rides it out in its own process: librdkafka can block forever in
    send_offsets_to_transaction after a broker restart (it did, before: the worker hung and ignored
    SIGTERM), so that call is bounded and a stuck producer is replaced. Every rollout is scored
    exactly once, nothing restarts, and SIGTERM then stops the worker within the bound."""
    from pipeline import codec
    from pipeline.admin import ensure_topics
    from pipeline.config import dump_toml
    from pipeline.kafka import Consumer, Producer, client_conf
    from rlstream.broker import LocalBroker
    from rlstream.config import BrokerConfig, load_config
    from tests.test_reward_worker import traj

    broker = LocalBroker(BrokerConfig(port=0, data_dir=tmp_path / "broker", heap_mb=512))
    bootstrap = broker.start(progress=lambda m: None, owned=True)["bootstrap"]
    n = 240
    try:
        cfg = load_config(
            None,
            [f"kafka.bootstrap_servers={bootstrap}", "topics.prefix=restart.", f"run_dir={tmp_path / 'runs'}",
             "reward.executor=thread", "reward.max_batch_size=8", "reward.chaos_delay_in_txn_ms=200",
             "reward.worker_id=reward-0", "reward.group_instance_id=reward-0",  # as rlstream demo runs it
             "liveness.watchdog_s=20", "liveness.shutdown_timeout_s=20", "topics.rollouts.partitions=2"],
            environ={},
        )  # fmt: skip
        ensure_topics(cfg)
        (tmp_path / "job.toml").write_text(dump_toml(cfg))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")} | {"PYTHONUNBUFFERED": "1"}
        policy = RestartPolicy(max_restarts=5, window_s=600, backoff_s=1)
        with Supervisor(tmp_path / "logs", env, policy) as sup:
            sup.start("reward-0", ["reward", "--config", str(tmp_path / "job.toml")])
            producer = Producer(client_conf(cfg, "test", kind="producer"))

            def feed():
                for i in range(n):
                    producer.produce(cfg.topics.name("rollouts"), codec.encode("Trajectory", traj(i, "abc", f"g{i}")),
                                     key=f"g{i}".encode())  # fmt: skip
                    time.sleep(0.1)

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
            scored = Consumer(client_conf(cfg, "test", kind="consumer"))
            deadline = time.monotonic() + 30
            while not any(True for _ in scored.read_to_end(cfg.topics.name("scored"), timeout=30)):
                assert time.monotonic() < deadline, "nothing scored before the restart"
                sup.check()
                time.sleep(0.5)
            broker.stop(progress=lambda m: None)  # mid-stream: transactions are open most of the time
            for _ in range(24):
                sup.check()
                time.sleep(0.5)
            broker.start(progress=lambda m: None, owned=True)
            feeder.join(120)
            producer.flush_patiently(120)
            producer.close()
            deadline = time.monotonic() + 300
            while True:
                sup.check()
                recs = [codec.decode_as(m.value(), "ScoredTrajectory")
                        for m in scored.read_to_end(cfg.topics.name("scored"), timeout=60)]  # fmt: skip
                if len(recs) >= n or time.monotonic() > deadline:
                    break
                time.sleep(1)
            scored.close()
            sources = [(r["source_partition"], r["source_offset"]) for r in recs]
            assert len(set(sources)) == n, f"{len(set(sources))} of {n} rollouts scored"
            assert len(sources) == n, "a rollout was scored twice"
            restarts = sup.restarts().get("reward-0", 0)
            t0 = time.monotonic()
            codes = sup.stop_all(timeout=60)
        assert codes["reward-0"] == 0 and time.monotonic() - t0 < 40, codes
        assert restarts == 0, (tmp_path / "logs" / "reward-0.log").read_text()[-3000:]  # ridden out in-process
    finally:
        broker.stop(progress=lambda m: None)


def test_a_declared_section_keeps_a_role_with_a_keepalive_hook_visibly_alive(monkeypatch):
    """Inside a declared long section (e.g. a transactional producer replaced while its coordinator
    recovers) the main loop publishes nothing; the keepalive hook runs from a thread meanwhile, so a
    supervisor that watches metrics does not take the wait for a hang. Outside a section it is not
    called, and a role without the hook gets no thread."""
    import pipeline.worker as worker_mod
    from pipeline.worker import Worker
    from rlstream.config import load_config

    monkeypatch.setattr(worker_mod, "KEEPALIVE_S", 0.05)
    calls: list[str] = []

    class Waiting(Worker):
        role = "test"

        def keepalive(self):
            calls.append(threading.current_thread().name)

        def run_once(self):
            with self.section("a long declared wait", 60):
                deadline = time.monotonic() + 120
                while len(calls) < 3 and time.monotonic() < deadline:
                    time.sleep(0.05)
            return False

    w = Waiting(load_config(None, []))
    w.run()
    assert len(calls) >= 3 and set(calls) == {"keepalive"}
    after = len(calls)
    time.sleep(0.3)
    assert len(calls) == after  # the thread ended with the section
    assert not [t for t in threading.enumerate() if t.name == "keepalive"]
