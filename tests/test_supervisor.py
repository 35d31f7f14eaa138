"""The process supervisor: a dead child is reported loudly; stop_all stops everyone by PID."""

import sys

import pytest

from pipeline.ports import pid_alive
from rlstream.supervisor import ChildDied, Supervisor


def test_dead_child_is_reported_and_others_stopped(tmp_path):
    with Supervisor(tmp_path) as sup:
        sleeper = sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        sup.start("crasher", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
        sup.start("finisher", [sys.executable, "-c", "pass"], may_exit=True)
        sup.children["crasher"].proc.wait(10)
        sup.children["finisher"].proc.wait(10)
        with pytest.raises(ChildDied) as ei:
            sup.check()
        assert ei.value.name == "crasher" and ei.value.code == 3 and "boom" in ei.value.log_tail
        pid = sleeper.proc.pid
        codes = sup.stop_all(timeout=5)
    assert codes["sleeper"] is not None and not pid_alive(pid)


def test_finished_child_that_may_exit_is_not_an_error(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start("finisher", [sys.executable, "-c", "pass"], may_exit=True)
        sup.children["finisher"].proc.wait(10)
        assert sup.check() == ["finisher"]
