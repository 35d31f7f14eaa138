"""The fork server on a GPU machine: a child forked from a process that has initialised CUDA cannot
use the GPU, so the server refuses to fork once CUDA is initialised in it (at its ready check, or
before any later fork) and the supervisor starts the roles as plain processes, saying why in one
warning line; the modules it preloads make no ``torch.cuda`` call at import time. On this machine
(no GPU) the condition is forced: ``RLSTREAM_FORKSERVER_ASSUME_CUDA=1`` in the server's environment,
or a preloaded stand-in for torch whose CUDA turns initialised after the ready check."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from rlstream.forkserver import ForkedProc
from rlstream.supervisor import Supervisor
from tests.conftest import CLUSTER_TOPICS, REPO, env_vars, run_cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux only")

PRELOAD = ["rlstream.cli", "consumers.reward.worker"]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _wait_done(sup: Supervisor, names: set[str]) -> None:
    import time

    deadline = time.monotonic() + 120
    while not names <= set(sup.check()):
        assert time.monotonic() < deadline, f"{names} did not finish"
        time.sleep(0.05)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rlstream.forkserver" and r.levelno == logging.WARNING]


def test_cuda_initialised_at_the_ready_check_means_plain_processes(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlstream.forkserver")
    with Supervisor(tmp_path, _env(RLSTREAM_FORKSERVER_ASSUME_CUDA="1"), preload=PRELOAD) as sup:
        a = sup.start("help", ["--help"], may_exit=True)
        b = sup.start("help2", ["--help"], may_exit=True)
        assert isinstance(a.proc, subprocess.Popen) and isinstance(b.proc, subprocess.Popen)
        _wait_done(sup, {"help", "help2"})
        assert a.proc.returncode == 0 and "Usage: python -m rlstream" in (tmp_path / "help.log").read_text()
        assert not sup.forks.usable and "CUDA is initialised" in sup.forks.ready["why"]
    said = _warnings(caplog)
    assert len(said) == 1 and "starting plain processes" in said[0] and "CUDA is initialised" in said[0], said


def test_cuda_initialised_after_the_ready_check_refuses_each_later_fork(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlstream.forkserver")
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "cuda_later.py").write_text(textwrap.dedent("""
        # a stand-in for torch in the fork server: CUDA not initialised at its ready check, initialised
        # from its first fork request on
        import sys, types
        calls = []
        def is_initialized():
            calls.append(1)
            return len(calls) > 1
        sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=is_initialized))
    """))  # fmt: skip
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), *sys.path]))
    with Supervisor(tmp_path / "logs", env, preload=["cuda_later"]) as sup:
        assert sup.forks.wait_ready() and sup.forks.ready["ok"]
        a = sup.start("help", ["--help"], may_exit=True)
        b = sup.start("help2", ["--help"], may_exit=True)
        assert isinstance(a.proc, subprocess.Popen) and isinstance(b.proc, subprocess.Popen)
        assert not isinstance(b.proc, ForkedProc) and "CUDA is initialised" in sup.forks.refused
        _wait_done(sup, {"help", "help2"})
        assert a.proc.returncode == 0 and b.proc.returncode == 0
        assert sup.forks.proc.poll() is None  # the server itself stays up (roles forked before keep their parent)
    said = _warnings(caplog)
    assert len(said) == 1 and "refuses to fork" in said[0] and "CUDA is initialised" in said[0], said


def test_the_preloaded_modules_make_no_cuda_call_at_import_time():
    """Every module the job's fork server preloads (and a model's modeling module), imported after
    torch with its CUDA entry points watched: none is called, and the server's check finds CUDA
    not initialised (it asks ``torch.cuda.is_initialized``, which initialises nothing)."""
    script = textwrap.dedent("""
        import importlib, json, sys
        import torch
        calls = []
        def watch(obj, name):
            real = getattr(obj, name)
            def called(*a, **k):
                calls.append(name)
                return real(*a, **k)
            setattr(obj, name, called)
        for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device",
                     "is_bf16_supported", "get_device_properties", "get_device_capability"):
            watch(torch.cuda, name)
        watch(torch._C, "_cuda_getDeviceCount")
        from rlstream.forkserver import ROLE_MODULES, THEN
        for m in [*ROLE_MODULES, "transformers.models.llama.modeling_llama"]:
            if m != THEN:
                importlib.import_module(m)
        from rlstream.zygote import cuda_refusal
        print(json.dumps({"calls": calls, "refusal": cuda_refusal()}))
    """)  # fmt: skip
    env = {k: v for k, v in _env().items() if k != "RLSTREAM_FORKSERVER_ASSUME_CUDA"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"calls": [], "refusal": None}, got


@pytest.mark.kafka
@pytest.mark.slow
def test_a_job_whose_fork_server_has_cuda_runs_its_roles_as_plain_processes(kafka_bootstrap, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(
        RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        RLSTREAM_RUN_DIR=str(tmp_path / "runs"),
        RLSTREAM_HOME=str(tmp_path / "home"),
        RLSTREAM_FORKSERVER_ASSUME_CUDA="1",
        PYTHONUNBUFFERED="1",
        **env_vars(CLUSTER_TOPICS),
    )
    name = f"fc{uuid.uuid4().hex[:8]}"
    proc = run_cli(["run", str(REPO / "examples/next-digit.toml"), "--steps", "2", "--no-live", "--set",
                    f"job.name={name}", "--set", "rollout.max_inflight=32"], env, timeout=900)  # fmt: skip
    run_dir = Path(env["RLSTREAM_RUN_DIR"]) / name
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "ok" and report["steps_completed"] == 2
    events = [json.loads(x) for x in (run_dir / "logs" / "events.jsonl").read_text().splitlines() if x.strip()]
    starts = [e for e in events if e["event"] == "start"]
    assert starts and not any(e.get("forked") for e in starts), starts
    said = [
        line
        for line in (proc.stdout + proc.stderr + _launcher_log(run_dir)).splitlines()
        if "starting plain processes" in line
    ]
    assert said and all("CUDA is initialised" in line for line in said), said


def _launcher_log(run_dir: Path) -> str:
    return "".join(
        p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log") if p.name != "forkserver.log"
    )
