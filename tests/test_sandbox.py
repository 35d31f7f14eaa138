"""The code-execution sandbox and the ``code`` reward: hostile programs are contained and score 0;
correct ones score 1."""

from __future__ import annotations

import json
import os
import socket
import textwrap

import pytest

from libs.rewards.base import build
from libs.rewards.code import extract_code
from libs.rewards.sandbox import SandboxLimits, capabilities, processes_of, run_python, sandbox_uid
from pipeline.kafka import wait_for

FAST = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mb=256, max_processes=8, max_output_bytes=64 * 1024)
"""For programs that must end by the wall limit (they sleep)."""
ROOMY = SandboxLimits(wall_s=60.0, cpu_s=1, memory_mb=256, max_processes=8, max_output_bytes=64 * 1024)
"""For programs that must end by another limit, or finish: a wall limit a loaded machine cannot hit
first (at load 10 on 2 cores, one CPU-second of a spinning program took more than FAST's 3 s wall)."""
SQUARE = "n = int(input())\nprint(n * n)\n"
TESTS = {"tests": [{"input": "3\n", "output": "9\n"}, {"input": "-4\n", "output": "16"}, {"input": "0", "output": "0"}]}


def code_traj(program: str, tests=TESTS) -> dict:
    return {"task": "code", "prompt_text": "square", "response_text": program, "reference": json.dumps(tests)}


def score(program: str, **kw) -> float:
    limits = {k: getattr(ROOMY, k) for k in ("wall_s", "cpu_s", "memory_mb", "max_processes", "max_output_bytes")}
    return build("code", {**limits, **kw})(code_traj(program)).reward


def gone(pids: list[int]) -> bool:
    """None of ``pids`` is alive (zombies count as gone)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] not in ("Z", "X"):
                    return False
        except (FileNotFoundError, ProcessLookupError):
            pass
    return True


def test_correct_program_passes_and_scores_one():
    res = run_python(SQUARE, "12\n", ROOMY)
    assert res.status == "ok" and res.stdout == "144\n" and res.returncode == 0
    assert score(SQUARE) == 1.0
    fenced = f"Here you go:\n```python\n{SQUARE}```\nDone."
    assert extract_code(fenced) == SQUARE and score(fenced) == 1.0
    assert score("print(9)") == 0.0  # wrong on two of three tests
    partial = build("code", {"partial": True, "wall_s": 60.0})(code_traj("print(9)"))
    assert partial.reward == pytest.approx(1 / 3) and partial.details["passed"] == 1.0


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    res = run_python("while True:\n    pass\n", "", ROOMY)
    assert res.status == "cpu_limit" and res.returncode < 0
    assert score("while True:\n    pass\n") == 0.0


def test_sleeping_program_is_killed_at_the_wall_limit():
    res = run_python("import time\nprint('start', flush=True)\ntime.sleep(600)\n", "", SandboxLimits(wall_s=1.0))
    assert res.status == "timeout" and res.stdout == "start\n"


def test_fork_bomb_is_bounded_and_leaves_no_process():
    bomb = textwrap.dedent(
        """
        import os, sys, time
        for level in range(7):            # at most 2**7 processes even without any limit
            try:
                pid = os.fork()
            except OSError:
                break
            if pid:
                sys.stdout.write(f"{pid}\\n"); sys.stdout.flush()
        time.sleep(600)
        """
    )
    res = run_python(bomb, "", FAST)
    pids = [int(x) for x in res.stdout.split()]
    assert res.status == "timeout"
    assert 1 <= len(pids) < 127  # some forks succeeded, the limit stopped the rest
    if sandbox_uid(FAST) is not None:
        assert len(pids) < FAST.max_processes  # RLIMIT_NPROC counts only this run's uid
        assert wait_for(lambda: not processes_of(sandbox_uid(FAST)), 60)
    assert wait_for(lambda: gone(pids), 60)
    assert score(bomb, wall_s=3.0) == 0.0


def test_escaped_daemon_is_swept():
    if not capabilities()["uid_drop"]:
        pytest.skip("needs root: without a uid drop a process that calls setsid() escapes the group kill")
    daemon = textwrap.dedent(
        """
        import os, time
        pid = os.fork()
        if pid == 0:
            os.setsid()
            time.sleep(600)
        print(pid)
        """
    )
    res = run_python(daemon, "", ROOMY)
    assert res.status == "ok"
    assert wait_for(lambda: gone([int(res.stdout)]), 60)


def test_memory_hog_fails_inside_its_limit():
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
    res = run_python(hog, "", ROOMY)
    assert res.status == "runtime_error" and "MemoryError" in res.stderr
    assert score(hog) == 0.0


def test_huge_output_is_capped():
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    res = run_python(flood, "", ROOMY)
    assert res.status == "output_limit"
    assert len(res.stdout) <= ROOMY.max_output_bytes
    assert score(flood) == 0.0


def test_no_network_and_a_private_temp_dir():
    if capabilities()["network"] == "shared":
        pytest.skip("this OS gives no network namespace (documented fallback: network shared)")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        prog = textwrap.dedent(
            f"""
            import os, socket
            print(os.getcwd())
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as exc:
                print("blocked", exc.errno)
            """
        )
        res = run_python(prog, "", ROOMY)
    assert res.status == "ok"
    cwd, verdict = res.stdout.splitlines()
    assert verdict.startswith("blocked")
    assert not os.path.exists(cwd)  # removed after the run


def test_setup_failure_is_an_error_not_a_zero():
    lim = SandboxLimits(python="/nonexistent/python3", wall_s=3.0)
    assert run_python("print(1)", "", lim).status == "setup_error"
    from libs.rewards.base import RewardError

    with pytest.raises(RewardError, match="sandbox setup failed"):
        build("code", {"python": "/nonexistent/python3"})(code_traj(SQUARE))
