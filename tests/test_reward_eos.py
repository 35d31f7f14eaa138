"""Exactly-once scoring with real ``rlstream reward`` processes: workers joining and leaving
mid-stream, and ``kill -9`` in the middle of transactions. Reading the scored topic with
read_committed must give every trajectory exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pipeline import codec
from pipeline.admin import Admin
from pipeline.kafka import Producer, client_conf, decode_message, wait_for
from tests.conftest import rlstream_cmd
from tests.test_codec import make_trajectory
from tests.test_reward_worker import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class Worker:
    """One ``rlstream reward`` process (restartable: each incarnation logs to its own file)."""

    def __init__(self, env: dict, wid: str, log_dir: Path, sets: list[str]):
        self.env, self.wid, self.log_dir, self.sets = env, wid, log_dir, sets
        self.incarnation = 0
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.wid}.{self.incarnation}.log"

    def start(self) -> Worker:
        self.incarnation += 1
        args = [*rlstream_cmd(), "reward", "--set", f"reward.worker_id={self.wid}"]
        for s in self.sets:
            args += ["--set", s]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def trajectory(i: int) -> tuple[bytes, bytes]:
    """Trajectory i of group g<i//8>; every third answer is wrong (reward 0)."""
    t = make_trajectory(i, 4)
    group = f"g{i // 8}"
    t.update(trajectory_id=f"{group}/{i % 8}", group_id=group, sample_index=i % 8, group_size=8)
    t.update(response_text="abc" if i % 3 else "abd", reference=json.dumps({"answer": "abc"}))
    return group.encode(), codec.encode("Trajectory", t)


def wait_drained(cfg, timeout: float) -> bool:
    admin = Admin(client_conf(cfg, "test"))
    return wait_for(lambda: not any(admin.lag(cfg.reward.group_id, cfg.topics.name("rollouts")).values()), timeout, 0.5)


def check_exactly_once(cfg, n: int) -> list[dict]:
    recs = [decode_message(m, "ScoredTrajectory") for m in read_all(cfg, "scored", n, timeout=120)]
    ids = [r["trajectory"]["trajectory_id"] for r in recs]
    assert len(set(ids)) == n, f"{n - len(set(ids))} trajectories missing"
    assert len(ids) == n, f"{len(ids) - n} duplicates"
    for r in recs:
        i = int(r["trajectory"]["group_id"][1:]) * 8 + r["trajectory"]["sample_index"]
        assert r["reward"] == (1.0 if i % 3 else 0.0), r["trajectory"]["trajectory_id"]
    assert read_all(cfg, "dlq") == []
    return recs


def fail_with_logs(workers: list[Worker], msg: str):
    tails = "\n".join(f"--- {w.log_path.name}\n{w.log()[-3000:]}" for w in workers)
    pytest.fail(f"{msg}\n{tails}")


@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_workers_join_and_leave_mid_stream(make_config, cli_env, tmp_path, protocol):
    """``consumer``: the KIP-848 group protocol (``kafka.consumer``), whose assignments the broker
    makes and hands out incrementally, with the transactions' offsets committed by member epoch."""
    cfg = make_config()
    n, chunk = 800, 50
    sets = [f'kafka.consumer={{"group.protocol"="{protocol}"}}'] if protocol == "consumer" else []
    sets += [
        "reward.executor=process",
        "reward.pool_size=1",
        'reward.default=[{name="tests.test_reward_fns:slow_exact", kwargs={ms=2}}]',
        "reward.max_batch_size=32",
        "reward.max_batch_ms=200",
        "reward.session_timeout_ms=6000",
        "reward.transaction_timeout_ms=10000",
        # each commit (on the commit thread) lasts >= 100 ms, so rebalances land while one is in flight:
        # the revoke waits for it, and the partitions move with their offsets committed
        "reward.chaos_delay_in_txn_ms=100",
    ]
    w1, w2, w3 = (Worker(cli_env, f"w{k}", tmp_path, sets) for k in (1, 2, 3))
    workers = [w1, w2, w3]
    w1.start(), w2.start()
    try:
        if not wait_for(lambda: "partitions assigned" in w1.log() and "partitions assigned" in w2.log(), 90):
            fail_with_logs(workers, "workers did not join")
        with Producer(client_conf(cfg, "test", kind="producer")) as p:
            for c in range(n // chunk):
                for i in range(c * chunk, (c + 1) * chunk):
                    key, value = trajectory(i)
                    p.produce(cfg.topics.name("rollouts"), value, key=key)
                p.flush()
                if c == 3:
                    w3.start()
                    if not wait_for(lambda: "partitions assigned" in w3.log(), 90):
                        fail_with_logs(workers, "w3 did not join")
                if c == 10:
                    assert w3.terminate() == 0  # leaves the group; the others keep going
                time.sleep(0.5)
        if not wait_drained(cfg, 120):
            fail_with_logs(workers, "the group did not drain rl.rollouts")
        assert w1.alive() and w2.alive()  # never stopped by the rebalances
    finally:
        codes = [w.terminate() if w.alive() else w.proc.returncode for w in workers if w.proc]
    assert codes == [0, 0, 0]
    recs = check_exactly_once(cfg, n)
    by_worker = {w: sum(r["scorer_id"] == w for r in recs) for w in ("w1", "w2", "w3")}
    assert all(by_worker.values()), by_worker  # w3 scored while it was a member
    assert "stopping after the current batch" in w3.log()


def test_kill_9_mid_transaction_repeatedly(make_config, cli_env, tmp_path):
    cfg = make_config()
    n, verified_kills_needed = 1200, 10
    sets = [
        "reward.executor=thread",
        "reward.pool_size=2",
        'reward.default=[{name="tests.test_reward_fns:slow_exact", kwargs={ms=2}}]',
        "reward.max_batch_size=20",
        "reward.max_batch_ms=100",
        "reward.session_timeout_ms=6000",
        "reward.transaction_timeout_ms=10000",
        "reward.chaos_delay_in_txn_ms=1000",  # records produced, then 1 s before the offsets and commit
        "log_level=DEBUG",
    ]
    workers = [Worker(cli_env, wid, tmp_path, [*sets, f"reward.group_instance_id={wid}"]) for wid in ("k1", "k2")]
    for w in workers:
        w.start()
    done = threading.Event()
    produced = []

    def feed():  # a steady stream while the kills go on, then the rest at once
        with Producer(client_conf(cfg, "test", kind="producer")) as p:
            for i in range(n):
                key, value = trajectory(i)
                p.produce(cfg.topics.name("rollouts"), value, key=key)
                produced.append(i)
                if not done.is_set() and i % 8 == 7:
                    p.flush()
                    time.sleep(0.5)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    rng = random.Random(int(os.environ.get("RLSTREAM_TEST_SEED", "4")))
    verified = attempts = 0
    try:
        while verified < verified_kills_needed and attempts < 2 * verified_kills_needed:
            victim = workers[attempts % 2]
            attempts += 1
            if not wait_for(lambda v=victim: "transaction open" in v.log() or not v.alive(), 90, 0.02):
                fail_with_logs(workers, f"{victim.wid} opened no transaction")
            if not victim.alive():
                fail_with_logs(workers, f"{victim.wid} died")
            time.sleep(rng.uniform(0, 0.5))  # a random moment inside the 1 s window
            victim.kill9()
            text = victim.log()
            if "transaction committed" not in text[text.rindex("transaction open") :]:
                verified += 1  # killed between producing and committing
            victim.start()
        assert verified >= verified_kills_needed, f"only {verified} of {attempts} kills landed mid-transaction"
        done.set()
        feeder.join(120)
        assert len(produced) == n
        if not wait_drained(cfg, 120):
            fail_with_logs(workers, "the group did not drain rl.rollouts")
    finally:
        done.set()
        codes = [w.terminate() if w.alive() else w.proc.returncode for w in workers]
    assert codes == [0, 0]
    check_exactly_once(cfg, n)
