"""The hot-standby trainer (``trainer.standby``, ``job.trainer_standby``): a second trainer process
waits, everything imported, on the checkpoint dir's lock and takes over the moment the holder dies
(kill -9 included); a stop while it waits ends it cleanly. Real processes, a real broker."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TINY = ["model.hidden_size=32", "model.num_heads=2", "model.num_layers=1", "model.intermediate_size=64"]
REPO = Path(__file__).resolve().parent.parent
HOLD = (
    "import sys, time\n"
    "from consumers.trainer.state import TrainerCheckpoints\n"
    "handle = TrainerCheckpoints(sys.argv[1]).lock()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def start_in_thread(trainer) -> tuple[threading.Thread, list]:
    """``trainer.start()`` on a thread; what it raised (a BaseException included) lands in the list."""
    raised: list = []

    def go():
        try:
            trainer.start()
        except BaseException as exc:  # StopRequested is a BaseException
            raised.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, raised


@pytest.mark.kafka
def test_a_standby_takes_over_when_the_holder_is_killed_and_a_stop_ends_one_that_waits(make_config, caplog):
    from consumers.trainer.state import TrainerCheckpoints
    from consumers.trainer.worker import Trainer
    from pipeline.worker import StopRequested

    caplog.set_level(logging.INFO, logger="consumers.trainer.standby")
    cfg = make_config(*TINY, "trainer.standby=true")
    root = Path(cfg.run_dir) / "trainer"
    ckpts = TrainerCheckpoints(root)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    standby = waiter = None
    try:
        assert holder.stdout.readline().strip() == "held"  # the holder imports torch first: no deadline of ours
        assert ckpts.holder() == holder.pid

        standby = Trainer(cfg, max_steps=1)
        thread, raised = start_in_thread(standby)
        wait_until(lambda: "standby: another trainer holds" in caplog.text, 300, "the standby to start waiting")
        assert thread.is_alive() and standby._lock is None  # it waits: the dir is held

        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        thread.join(300)  # takes the lock, then the set-up: model, checkpoint, Kafka
        assert not thread.is_alive() and raised == []
        assert standby._lock is not None and ckpts.holder() == os.getpid()
        assert "standby: taking over the checkpoint dir" in caplog.text

        waiter = Trainer(cfg, max_steps=1)  # a second standby, behind the one that took over
        thread2, raised2 = start_in_thread(waiter)
        wait_until(lambda: caplog.text.count("standby: another trainer holds") >= 2, 120, "the second standby")
        waiter.stop()
        thread2.join(60)
        assert not thread2.is_alive() and len(raised2) == 1 and isinstance(raised2[0], StopRequested)
        assert ckpts.holder() == os.getpid()  # the stopped standby never touched the lock
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)
        holder.stdout.close()
        for t in (waiter, standby):
            if t is not None:
                t.close()


def test_job_trainer_standby_runs_two_trainer_roles_that_both_wait_their_turn():
    from rlstream.config import load_config
    from rlstream.launcher import STANDBY, standard_roles

    cfg = load_config(None, [])
    plain = [r for r in standard_roles(cfg, 1, 1) if r.command == "train"]
    assert [r.name for r in plain] == ["trainer"] and plain[0].settings == {}
    both = [r for r in standard_roles(cfg, 1, 1, 9100, trainer_standby=True) if r.command == "train"]
    assert [r.name for r in both] == ["trainer", STANDBY]
    assert all(r.settings == {"trainer.standby": True} and r.may_exit for r in both)
    assert both[0].metrics_port == both[1].metrics_port  # only the active one serves it


def test_with_a_standby_the_job_ends_once_both_trainer_processes_have_ended(tmp_path):
    """The launcher's end of a run with a standby: one train process finished while the other still
    runs (the finisher in its own teardown, or the standby about to see the run done) is not the end
    yet; both ended is, and so is the bound (liveness.shutdown_timeout_s) when the other lingers.
    Real child processes under the real supervisor."""
    import sys

    from rich.console import Console

    from rlstream.config import load_config
    from rlstream.launcher import STANDBY, Launcher, standard_roles
    from rlstream.supervisor import Supervisor

    cfg = load_config(None, ["liveness.shutdown_timeout_s=5"])
    roles = standard_roles(cfg, 1, 1, trainer_standby=True)
    launcher = Launcher(cfg, tmp_path, roles, title="t", live=False, console=Console(quiet=True))
    sup = Supervisor(tmp_path / "logs")
    try:
        sup.start("trainer", [sys.executable, "-c", "pass"], may_exit=True)
        sup.start(STANDBY, [sys.executable, "-c", "import time; time.sleep(60)"], may_exit=True)
        wait_until(lambda: "trainer" in sup.check(), 60, "the first trainer process to finish")
        t0 = time.monotonic()
        assert not launcher._trained(sup, set(sup.check()), t0)  # the other one still runs
        assert launcher._trained(sup, set(sup.check()), t0 + 6)  # past the bound: the job may end
        launcher._trained_at = None
        sup.stop(STANDBY, timeout=20)
        assert launcher._trained(sup, set(sup.check()), time.monotonic())  # both ended
        assert not launcher._trained(sup, set(), time.monotonic())  # nobody finished: not the end
    finally:
        sup.stop_all(20)
