"""The launcher says a role it cannot hear from: a process stopped (SIGSTOP) or a role whose
metrics went silent, when it begins and when it ends (``rlstream.role_states``)."""

import os
import signal
import subprocess
import time

from rlstream.role_states import RoleStates, process_state


def _until(fn, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if got := fn():
            return got
        time.sleep(0.2)
    raise AssertionError("not within the deadline")


def test_a_stopped_process_is_said_while_it_is_stopped():
    proc = subprocess.Popen(["sleep", "120"])
    states = RoleStates(hang_after_s=90)
    try:
        assert states.check({"reward-0": proc.pid}, {}, time.time()) == []
        os.kill(proc.pid, signal.SIGSTOP)
        [(rec, line)] = _until(lambda: states.check({"reward-0": proc.pid}, {}, time.time()))
        assert process_state(proc.pid) == "T" and "stopped" in line and rec["end"] is None
        assert states.check({"reward-0": proc.pid}, {"reward-0": 40.0}, time.time()) == []  # said once
        os.kill(proc.pid, signal.SIGCONT)
        [(rec2, line2)] = _until(lambda: states.check({"reward-0": proc.pid}, {"reward-0": 41.0}, time.time()))
        assert rec2 is rec and rec["end"] is not None and line2.startswith("running again after")
        # its next metrics are on their way: not said silent at once
        assert states.check({"reward-0": proc.pid}, {"reward-0": 42.0}, time.time()) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_silent_role_is_said_until_it_reports_again():
    states = RoleStates(hang_after_s=90)
    now = time.time()
    [(rec, line)] = states.check({"rollout-0": os.getpid()}, {"rollout-0": 20.0}, now)
    assert line.startswith("no metrics for 20 s") and "after 90 s" in line and rec["start"] == now - 20.0
    assert states.check({"rollout-0": os.getpid()}, {"rollout-0": 25.0}, now + 5) == []
    [(rec2, line2)] = states.check({"rollout-0": os.getpid()}, {}, now + 30)
    assert rec2 is rec and rec["end"] == now + 30 and line2.startswith("reporting again after 50 s")
