"""A rollout worker with static membership (``rollout.group_instance_id``): killed with kill -9 and
restarted under the same id, it takes its partitions back at once, without waiting for its dead
predecessor's session to expire, and no prompt is lost."""

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import rlstream_cmd
from tests.rollout_helpers import read_topic
from tests.test_rollout_cluster import DATA, _feed_env, audit_after_kill, start_worker, stop_all, wait_workers_joined

SESSION_S = 240
"""A session timeout far longer than the test waits: only a static member gets its partitions back."""


def test_config_refuses_two_static_ids(make_config):
    from pipeline.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="set one"):
        make_config("rollout.slots=2", "rollout.group_instance_id=gpu-7")


@pytest.mark.kafka
@pytest.mark.slow
def test_a_restarted_static_rollout_worker_takes_its_partitions_back_at_once(make_config, cli_env, tmp_path):
    cfg = make_config(f"feed.source={DATA}", "feed.epochs=2", "feed.rate=3", "rl.group_size=4")
    static = {
        "RLSTREAM_ROLLOUT__GROUP_INSTANCE_ID": "victim",
        "RLSTREAM_ROLLOUT__MAX_NEW_TOKENS": "200",
        "RLSTREAM_KAFKA__CONSUMER": f'{{"session.timeout.ms" = {SESSION_S * 1000}, "heartbeat.interval.ms" = 500}}',
    }
    victim = start_worker(cli_env, tmp_path, "victim", **static)
    feeder = restarted = None
    try:
        wait_workers_joined(cfg, ["victim"])
        feeder = subprocess.Popen([*rlstream_cmd(), "feed"], env={**cli_env, **_feed_env(cfg)})
        deadline = time.monotonic() + 180
        while not read_topic(cfg, "rollouts", "Trajectory", 0, 0):
            assert time.monotonic() < deadline, "the victim published no trajectory within 180 s"
            time.sleep(0.2)
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(30) == -signal.SIGKILL
        killed = time.monotonic()
        restarted = start_worker(cli_env, tmp_path, "victim", RLSTREAM_ROLLOUT__EXIT_WHEN_IDLE_S="10", **static)
        assert feeder.wait(180) == 0
        # a dynamic member's restart would wait out the dead member's session (SESSION_S) before its
        # rebalance; the static member is given the partitions as soon as it joins
        assert restarted.wait(SESSION_S - 60) == 0, (tmp_path / "victim.log").read_text()[-3000:]
        assert time.monotonic() - killed < SESSION_S - 60
    finally:
        stop_all(victim, restarted, feeder)
    audit_after_kill(cfg)
