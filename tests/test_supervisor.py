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


def test_a_role_stopped_by_a_config_error_is_not_restarted(tmp_path):
    """A supervised role that exits with EXIT_CONFIG (a ConfigError: restarting cannot mend it) stops
    the run at once, with its one-line reason in the log tail, instead of a crash loop."""
    from pipeline.errors import EXIT_CONFIG
    from rlstream.supervisor import RestartPolicy
    from tests.conftest import rlstream_cmd

    args = [*rlstream_cmd(), "reward", "--set", 'reward.default=[{name = "exact_mach"}]',
            "--set", "kafka.bootstrap_servers=127.0.0.1:9", "--set", "liveness.startup_timeout_s=600"]  # fmt: skip
    # (no broker there: the reward is built before the worker waits for Kafka)
    with Supervisor(tmp_path, restart=RestartPolicy(backoff_s=0.1)) as sup:
        sup.start("reward-0", args)
        sup.children["reward-0"].proc.wait(120)
        with pytest.raises(ChildDied) as ei:
            sup.check()
        assert ei.value.code == EXIT_CONFIG, ei.value.log_tail
        assert "not restarted" in str(ei.value) and "exact_mach" in ei.value.log_tail
        assert sup.restarts_total == 0


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler of its own for ``signum`` (``SigCgt`` in /proc)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_role_stopped_while_it_still_imports_exits_cleanly():
    """A supervised role that gets SIGTERM while Python is still importing (a job's end right after
    the role's restart) exits 0 with one line, not -15 (an unclean stop to the supervisor)."""
    import os
    import signal
    import subprocess
    import time

    from tests.conftest import rlstream_cmd

    env = {**os.environ, "RLSTREAM_PARENT_PID": str(os.getpid())}
    proc = subprocess.Popen([*rlstream_cmd(), "train"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches(proc.pid, signal.SIGTERM):  # the earliest handler, then at once the signal
            assert proc.poll() is None and time.monotonic() < deadline, "no SIGTERM handler appeared"
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "SIGTERM before the role had started: exiting" in err
