"""Rollout workers by slot with a warm spare (``rollout.slots``, ``producers.slots``): a slot is held
until its holder dies (kill -9 included), and a spare takes a killed worker's slot, its static
membership and its prompts, with nothing lost."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from producers.slots import RolloutSlots, slot_root
from tests.conftest import rlstream_cmd
from tests.rollout_helpers import read_topic
from tests.test_rollout_cluster import (
    DATA,
    _feed_env,
    audit_after_kill,
    kill_victim_and_drain,
    start_worker,
    stop_all,
    wait_workers_joined,
)


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got is not None:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_a_slot_is_held_until_its_holder_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from producers.slots import RolloutSlots
            s = RolloutSlots({str(tmp_path)!r}, 2)
            print(s.take(), flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "0"
        a = RolloutSlots(tmp_path, 2)
        assert a.holder(0) == holder.pid and a.holder(1) is None
        assert a.take() == 1 and a.take() == 1  # held: taking again keeps it
        spare = RolloutSlots(tmp_path, 2)
        assert spare.take() is None  # every slot held: a spare
        assert spare.instance_id(1) == "rollout-slot-1"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        assert _wait(spare.take, 60, "the dead holder's slot") == 0  # the OS freed its lock
        assert spare.holder(0) == os.getpid()
        a.release()
        assert RolloutSlots(tmp_path, 2).take() == 1
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.stdout.close()


@pytest.mark.kafka
@pytest.mark.slow
def test_a_spare_takes_over_a_killed_workers_slot_and_prompts(make_config, cli_env, tmp_path):
    cfg = make_config(f"feed.source={DATA}", "feed.epochs=2", "feed.rate=3", "rl.group_size=4")
    slots = {"RLSTREAM_ROLLOUT__SLOTS": "1", "RLSTREAM_ROLLOUT__MAX_NEW_TOKENS": "200"}
    victim = start_worker(cli_env, tmp_path, "victim", **slots)
    # the spare starts once the victim holds the slot (else it could be the one to take it)
    slot = RolloutSlots(slot_root(cfg.model_copy(update={"run_dir": tmp_path / "runs"})), 1)
    _wait(lambda: slot.holder(0), 240, "the victim to take slot 0")
    spare = start_worker(cli_env, tmp_path, "spare", RLSTREAM_ROLLOUT__EXIT_WHEN_IDLE_S="20", **slots)
    feeder = None
    try:
        wait_workers_joined(cfg, ["victim", "spare"], timeout=240)  # the spare publishes metrics while it waits
        assert "spare: every rollout slot is held" in (tmp_path / "spare.log").read_text()
        feeder = subprocess.Popen([*rlstream_cmd(), "feed"], env={**cli_env, **_feed_env(cfg)})

        def victim_holds_the_slot():
            assert slot.holder(0) == victim.pid

        kill_victim_and_drain(cfg, victim, feeder, spare, tmp_path / "spare.log", victim_holds_the_slot)
    finally:
        stop_all(victim, spare, feeder)
    log = (tmp_path / "spare.log").read_text()
    assert "spare: taking over rollout slot" in log, log[-3000:]
    _, by_worker = audit_after_kill(cfg)
    assert by_worker["victim"] > 0 and by_worker["spare"] > 0, by_worker


def test_job_rollout_standby_runs_the_workers_by_slot_and_one_spare(make_config):
    from rlstream.launcher import ROLLOUT_SPARE, standard_roles

    cfg = make_config()
    plain = {r.name: r for r in standard_roles(cfg, 3, 1)}
    assert ROLLOUT_SPARE not in plain and all("rollout.slots" not in r.settings for r in plain.values())
    roles = {r.name: r for r in standard_roles(cfg, 3, 1, metrics_port_base=9100, rollout_standby=True)}
    rollouts = [r for r in roles.values() if r.command == "rollout"]
    assert sorted(r.name for r in rollouts) == ["rollout-0", "rollout-1", "rollout-2", ROLLOUT_SPARE]
    assert all(r.settings["rollout.slots"] == 3 for r in rollouts)  # one slot per worker, none for the spare
    assert roles[ROLLOUT_SPARE].settings["rollout.worker_id"] == ROLLOUT_SPARE
    assert roles[ROLLOUT_SPARE].metrics_port == 0 and roles["rollout-0"].metrics_port == 9100


@pytest.mark.kafka
@pytest.mark.slow
def test_a_fenced_slot_holder_replaces_its_consumer_and_loses_nothing(make_config, cli_env, tmp_path):
    """The scale chaos run's crash: a slot holder whose registration was taken by a consumer with its
    instance id (there librdkafka's own rejoin after a session expiry behind a broker fault; here an
    intruder does it on purpose) exited 2 with "Static consumer fenced by other consumer with same
    group.instance.id". It now replaces its consumer, takes the registration back, and every prompt
    is generated (at most twice: the fenced member's uncommitted ones)."""
    from pipeline.kafka import Consumer, client_conf

    cfg = make_config(f"feed.source={DATA}", "feed.epochs=2", "feed.rate=3", "rl.group_size=4")
    holder = start_worker(
        cli_env, tmp_path, "holder", RLSTREAM_ROLLOUT__SLOTS="1", RLSTREAM_ROLLOUT__EXIT_WHEN_IDLE_S="20",
        RLSTREAM_ROLLOUT__MAX_NEW_TOKENS="200", RLSTREAM_ROLLOUT__SESSION_TIMEOUT_MS="10000",
    )  # fmt: skip
    feeder = intruder = None
    log_path = tmp_path / "holder.log"
    try:
        wait_workers_joined(cfg, ["holder"], timeout=240)
        feeder = subprocess.Popen([*rlstream_cmd(), "feed"], env={**cli_env, **_feed_env(cfg)})
        _wait(
            lambda: True if read_topic(cfg, "rollouts", "Trajectory", 0, 0) else None,
            180,
            "the holder's first trajectory",
        )
        conf = {**client_conf(cfg, "intruder", kind="consumer"), "group.instance.id": RolloutSlots.instance_id(0),
                "session.timeout.ms": 10000}  # fmt: skip
        intruder = Consumer(conf, group_id=cfg.rollout.group_id)
        intruder.subscribe([cfg.topics.name("prompts")])
        _wait(lambda: (intruder.poll(0.2), intruder.assignment())[1] or None, 120, "the intruder's assignment")
        _wait(lambda: "replacing the consumer" in log_path.read_text() or None, 120, "the holder's replacement")
        assert feeder.wait(180) == 0
        assert holder.wait(300) == 0, log_path.read_text()[-3000:]
    finally:
        if intruder is not None:
            try:
                intruder.close()
            except Exception:  # fenced by the holder's new member: a fatal client may refuse to close
                pass
        stop_all(holder, feeder)
    _, by_worker = audit_after_kill(cfg)
    assert set(by_worker) == {"holder"}
    assert "Static consumer fenced" in log_path.read_text()
