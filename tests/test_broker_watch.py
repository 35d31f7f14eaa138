"""A local broker that a process starts for itself (``LocalBroker.start(owned=True)``: benches,
``rlstream run``/``demo``, chaos, the test fixture) dies with that process, even one killed with
``kill -9``; one started by ``rlstream broker start`` (not owned) keeps running. Real brokers."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipeline.ports import pid_alive

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

OWNER = textwrap.dedent(
    """
    import sys, time
    from rlstream.broker import LocalBroker
    from rlstream.config import BrokerConfig
    b = LocalBroker(BrokerConfig(port=0, data_dir=sys.argv[1], heap_mb=384))
    state = b.start(progress=lambda m: None, owned=sys.argv[2] == "owned")
    print(state["pid"], flush=True)
    time.sleep(600)
    """
)


def start_owner(data, mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(data), mode], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    line = proc.stdout.readline()  # the broker's pid, once it answers (or EOF if the start failed)
    assert line.strip().isdigit(), f"the owner did not start its broker (exit {proc.poll()})"
    return proc, int(line)


def wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not pid_alive(pid)


@pytest.mark.parametrize("mode", ["owned", "not-owned"])
def test_an_owned_broker_dies_with_its_killed_owner(tmp_path, mode):
    owner, broker = start_owner(tmp_path / "broker", mode)
    try:
        assert pid_alive(broker)
        owner.kill()  # kill -9: no finally, no atexit in the owner
        owner.wait(30)
        if mode == "owned":
            assert wait_dead(broker, 90), "the owned broker outlived its killed owner"
        else:
            time.sleep(3)  # what the watcher would have needed, many times over
            assert pid_alive(broker), "a broker nobody owns must keep running"
    finally:
        if pid_alive(broker):
            os.kill(broker, signal.SIGKILL)  # ours: its pid came from the owner we started
            wait_dead(broker, 30)
