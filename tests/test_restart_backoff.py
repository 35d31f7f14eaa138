"""The supervisor's restart timing: a child's first death in the window (and every kill injected
by a fault run) is restarted in the same ``check`` that saw it, with no backoff; the next deaths back
off, doubling from ``backoff_s``."""

import signal
import sys
import time

from rlstream.supervisor import RestartPolicy, Supervisor

DIES = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEPS = [sys.executable, "-c", "import time; time.sleep(120)"]


def _wait_dead(sup, name):
    sup.children[name].proc.wait(60)


def test_a_first_death_is_restarted_at_once_then_backoff(tmp_path):
    with Supervisor(tmp_path, restart=RestartPolicy(backoff_s=60, max_backoff_s=120)) as sup:
        sup.start("crasher", DIES)
        _wait_dead(sup, "crasher")
        sup.check()  # the death seen, and the restart started, in this one call
        assert sup.restarts() == {"crasher": 1} and sup.children["crasher"].restart_at is None
        _wait_dead(sup, "crasher")
        sup.check()  # the second death in the window: backoff_s (60 s) from now
        c = sup.children["crasher"]
        assert c.restart_at is not None and c.restart_at - time.monotonic() > 30
        sup.stop_all(timeout=5)


def test_an_injected_kill_is_restarted_at_once(tmp_path):
    with Supervisor(tmp_path, restart=RestartPolicy(backoff_s=60)) as sup:
        first = sup.start("role", SLEEPS).proc.pid
        assert sup.inject("role", signal.SIGKILL) == first
        _wait_dead(sup, "role")
        sup.check()
        c = sup.children["role"]
        assert c.restart_at is None and c.proc.pid != first and c.proc.poll() is None
        assert [e["event"] for e in sup.events if e["name"] == "role"] == ["start", "signal", "exit", "restart"]
        sup.stop_all(timeout=5)
