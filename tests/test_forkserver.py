"""The supervisor's fork server (``rlstream.forkserver``): roles forked from one process that has
imported their modules behave as plain ``python -m rlstream`` processes to the supervisor (exit
codes, kill -9, restarts, stop by PID), never outlive it, and any trouble with the server falls
back to plain processes."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipeline.errors import EXIT_CONFIG
from pipeline.ports import pid_alive
from rlstream.forkserver import ForkedProc
from rlstream.supervisor import ChildDied, RestartPolicy, Supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux only")

PRELOAD = ["rlstream.cli", "consumers.reward.worker"]
# a role that runs until stopped, with no broker: it retries Kafka for up to 600 s
# (short Kafka requests, so it notices SIGTERM between two of them within seconds)
WAITING_ROLE = ["reward", "--set", "kafka.bootstrap_servers=127.0.0.1:9", "--set", "liveness.startup_timeout_s=600",
                "--set", "kafka.request_timeout_s=2"]  # fmt: skip


def _until(cond, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def test_forked_roles_exit_codes_kill_restart_and_stop(tmp_path):
    with Supervisor(tmp_path, _env(), RestartPolicy(backoff_s=0.1), preload=PRELOAD) as sup:
        helper = sup.start("help", ["--help"], may_exit=True)
        assert isinstance(helper.proc, ForkedProc)
        _until(lambda: "help" in sup.check(), what="--help to finish")
        assert helper.proc.returncode == 0
        assert "Usage: python -m rlstream" in (tmp_path / "help.log").read_text()

        role = sup.start("reward-0", WAITING_ROLE)
        first = role.proc.pid
        assert sup.inject("reward-0") == first  # kill -9: an injected fault, restarted at once
        _until(lambda: (sup.check(), role.proc.pid != first)[1], what="the restart")
        assert isinstance(role.proc, ForkedProc) and not pid_alive(first)
        kinds = [(e["event"], e.get("code")) for e in sup.events if e["name"] == "reward-0"]
        assert ("exit", -signal.SIGKILL) in kinds and ("restart", None) in kinds

        # a configuration error: the role's own exit code and its one-line reason reach the supervisor
        bad = sup.start("reward-bad", ["reward", "--set", 'reward.default=[{name = "exact_mach"}]'])
        bad.proc.wait(120)
        with pytest.raises(ChildDied) as ei:
            while True:
                sup.check()
                time.sleep(0.05)
        assert ei.value.code == EXIT_CONFIG and "exact_mach" in ei.value.log_tail
        sup.children.pop("reward-bad")

        server, second = sup.forks.proc.pid, role.proc.pid
        codes = sup.stop_all(timeout=60)
    assert codes["reward-0"] == 0, (tmp_path / "reward-0.log").read_text()[-2000:]
    assert not pid_alive(second) and not pid_alive(server)


def test_a_dead_server_takes_its_roles_and_plain_processes_follow(tmp_path):
    with Supervisor(tmp_path, _env(), RestartPolicy(backoff_s=0.1), preload=PRELOAD) as sup:
        role = sup.start("reward-0", WAITING_ROLE)
        forked = role.proc.pid
        assert isinstance(role.proc, ForkedProc)
        os.kill(sup.forks.proc.pid, signal.SIGKILL)
        # the kernel sends the role SIGTERM when its parent, the server, dies; it is then restarted as
        # a plain process
        _until(lambda: (sup.check(), role.proc.pid != forked)[1], what="the role's restart")
        assert not pid_alive(forked)
        assert isinstance(role.proc, subprocess.Popen) and role.proc.poll() is None
        sup.stop_all(timeout=60)


def test_a_different_environment_or_threads_mean_plain_processes(tmp_path):
    # a child asked for with another environment (threads, devices) than the server imported under
    with Supervisor(tmp_path / "a", _env(), preload=PRELOAD) as sup:
        other = sup.start("help", ["--help"], may_exit=True, env={"OMP_NUM_THREADS": "2"})
        assert isinstance(other.proc, subprocess.Popen)
        same = sup.start("help2", ["--help"], may_exit=True, env={"RLSTREAM_SOMETHING": "1"})
        assert isinstance(same.proc, ForkedProc)
        _until(lambda: {"help", "help2"} <= set(sup.check()), what="both to finish")

    # a preloaded module that starts a thread: forking would be unsafe, so the server refuses
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "threaded_mod.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), *sys.path]))
    with Supervisor(tmp_path / "b", env, preload=["threaded_mod"]) as sup:
        child = sup.start("help", ["--help"], may_exit=True)
        assert isinstance(child.proc, subprocess.Popen)
        _until(lambda: "help" in sup.check(), what="--help to finish")
        assert not sup.forks.usable and "threads after the imports" in sup.forks.ready["why"]


def test_forked_roles_die_with_a_killed_supervisor(tmp_path):
    """kill -9 of the supervisor: the server gets SIGTERM (PR_SET_PDEATHSIG), and its roles theirs."""
    script = tmp_path / "sup.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, time
        from rlstream.supervisor import Supervisor
        sup = Supervisor({str(tmp_path / "logs")!r}, {{**os.environ, "OMP_NUM_THREADS": "1"}}, preload={PRELOAD!r})
        c = sup.start("reward-0", {WAITING_ROLE!r})
        print(json.dumps({{"server": sup.forks.proc.pid, "role": c.proc.pid, "forked": type(c.proc).__name__}}), flush=True)
        time.sleep(600)
    """))  # fmt: skip
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert pids["forked"] == "ForkedProc"
        assert pid_alive(pids["server"]) and pid_alive(pids["role"])
        proc.kill()
        proc.wait(30)
        _until(lambda: not pid_alive(pids["server"]) and not pid_alive(pids["role"]), what="server and role to die")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_forked_role_ends_as_an_interpreter_exit_would_without_the_module_teardown(tmp_path):
    """The server's children skip tearing down the modules they inherited but keep what a Python
    exit does: ``atexit`` handlers run (one registered by a preloaded module here), output is
    flushed, ``SystemExit``'s status is the exit code."""
    from rlstream.zygote import exit_code

    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "exit_mark.py").write_text(
        "import atexit, os\n"
        "def mark():\n"
        "    with open(os.environ['EXIT_MARK'], 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "atexit.register(mark)\n"
    )
    mark = tmp_path / "marks"
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), *sys.path]), EXIT_MARK=str(mark))
    with Supervisor(tmp_path / "logs", env, preload=["exit_mark", *PRELOAD]) as sup:
        helper = sup.start("help", ["--help"], may_exit=True)
        assert isinstance(helper.proc, ForkedProc)
        _until(lambda: "help" in sup.check(), what="--help to finish")
        assert helper.proc.returncode == 0
        assert "Usage: python -m rlstream" in (tmp_path / "logs" / "help.log").read_text()
        assert str(helper.proc.pid) in mark.read_text().split()
    assert exit_code(SystemExit()) == 0 and exit_code(SystemExit(3)) == 3 and exit_code(SystemExit("why")) == 1


def test_first_stage_roles_fork_while_the_server_still_imports_the_rest(tmp_path):
    """``first... --then rest...``: a feed or reward role forks as soon as the first modules are in,
    served between two of the others' imports (the first of them returns once a request waits on
    the server's stdin or was served; the second waits for a file); any other role waits until
    every module is in. A thread started by a second-stage module: the server refuses to fork from
    then on and exits, the role forked before it dies with it and is restarted as a plain process."""
    from rlstream.forkserver import FIRST_COMMANDS, THEN

    gate = tmp_path / "gate"
    mods = tmp_path / "mods"
    mods.mkdir()
    # returns once a request waits on the server's stdin, or once the server has forked it already
    (mods / "await_request.py").write_text(
        "import os, select, time\n"
        "deadline = time.monotonic() + 300\n"
        "children = f'/proc/self/task/{os.getpid()}/children'\n"
        "while time.monotonic() < deadline and not select.select([0], [], [], 0.05)[0]:\n"
        "    if open(children).read().strip():\n"
        "        break\n"
    )
    (mods / "gated_mod.py").write_text(
        "import os, time\n"
        "deadline = time.monotonic() + 300\n"
        f"while not os.path.exists({str(gate)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    (mods / "threaded_mod.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    env = _env(PYTHONPATH=os.pathsep.join([str(mods), *sys.path]))
    assert "reward" in FIRST_COMMANDS
    preload = [*PRELOAD, THEN, "await_request", "gated_mod"]
    with Supervisor(tmp_path / "a", env, RestartPolicy(backoff_s=0.1), preload=preload) as sup:
        role = sup.start("reward-0", WAITING_ROLE)
        assert isinstance(role.proc, ForkedProc) and pid_alive(role.proc.pid)
        assert sup.forks.first["ok"] and sup.forks.ready is None  # forked before the rest was in
        gate.touch()
        helper = sup.start("help", ["--help"], may_exit=True)  # not a first-stage role: after the rest
        assert isinstance(helper.proc, ForkedProc) and sup.forks.ready["ok"]
        _until(lambda: "help" in sup.check(), what="--help to finish")
        assert helper.proc.returncode == 0 and role.proc.poll() is None
        codes = sup.stop_all(timeout=60)
    assert codes["reward-0"] == 0, (tmp_path / "a" / "reward-0.log").read_text()[-2000:]

    preload = [*PRELOAD, THEN, "await_request", "threaded_mod"]
    with Supervisor(tmp_path / "b", env, RestartPolicy(backoff_s=0.1), preload=preload) as sup:
        early = sup.start("reward-0", WAITING_ROLE)
        forked = early.proc.pid
        assert isinstance(early.proc, ForkedProc)
        late = sup.start("help", ["--help"], may_exit=True)
        assert isinstance(late.proc, subprocess.Popen)
        assert not sup.forks.usable and "threads after the imports" in sup.forks.ready["why"]
        _until(lambda: (sup.check(), early.proc.pid != forked)[1], what="the early role's restart")
        assert isinstance(early.proc, subprocess.Popen) and not pid_alive(forked)
        sup.stop_all(timeout=60)
