"""The CLI itself: fast help without torch, clear config errors."""

import subprocess
import sys

from tests.conftest import REPO


def test_help_does_not_import_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from rlstream.cli import app;"
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output;"
        "bad = [m for m in ('torch', 'transformers', 'deepspeed', 'vllm') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_error_is_one_clear_line():
    p = subprocess.run(
        [sys.executable, "-m", "rlstream", "--set", "rollout.max_inflight=0", "config", "show"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert "rollout.max_inflight" in p.stderr and "Traceback" not in p.stderr


def test_config_show_prints_resolved_toml():
    p = subprocess.run(
        [sys.executable, "-m", "rlstream", "config", "show", "--set", "rl.max_staleness=5"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "[rl]\nmax_staleness = 5" in p.stdout


def test_demo_layers_the_config_file_and_set_over_its_own_settings(tmp_path, monkeypatch):
    """`rlstream --config x.toml demo --set ...`: the file and --set win over the demo's settings,
    the demo's flags win over both, and the run's own values (run dir, bootstrap) over everything."""
    from rlstream.demo import DemoOptions, resolve

    for k in [k for k in __import__("os").environ if k.startswith("RLSTREAM_")]:
        monkeypatch.delenv(k)
    job = tmp_path / "x.toml"
    job.write_text(
        '[rl]\ngroups_per_step = 3\n[trainer]\nlr = 0.02\nmax_steps = 7\n[feed]\nsource = "/data/mine.jsonl"\n'
    )
    sets = ["trainer.lr=0.05", "rollout.max_inflight=5", f"run_dir={tmp_path}"]
    cfg = resolve(job, sets, DemoOptions(steps=9, k=0), "1", "h:1")
    run_dir = tmp_path / "demo-1"  # a job named demo-<run id> under the run dir
    assert cfg.rl.groups_per_step == 3 and cfg.rl.group_size == 8  # the file; the demo's default stays
    assert cfg.trainer.lr == 0.05 and cfg.rollout.max_inflight == 5  # --set over the file
    assert cfg.trainer.max_steps == 9 and cfg.rl.max_staleness == 0  # the demo's flags over the file
    assert str(cfg.feed.source) == "/data/mine.jsonl"  # a config file can replace the task
    assert cfg.feed.limit == 9 * 3 + 200
    assert cfg.run_dir == run_dir and cfg.kafka.bootstrap_servers == "h:1" and cfg.topics.prefix == "demo-1."


def test_a_crash_in_native_code_leaves_every_threads_stack():
    """Every rlstream process enables faulthandler: a segfault in a native library (one in
    librdkafka once ended a chaos launcher with nothing but its exit code) prints the Python stack of
    every thread to stderr, which is the role's log under the supervisor."""
    code = (
        "import ctypes, sys, threading\n"
        "from rlstream.cli import run_cli\n"
        "sys.argv = ['rlstream', '--help']\n"
        "try:\n    run_cli()\nexcept SystemExit:\n    pass\n"
        "threading.Thread(target=threading.Event().wait, name='bystander', daemon=True).start()\n"
        "def crash_here():\n    ctypes.string_at(0)\n"
        "crash_here()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -11, proc.stderr[-2000:]
    assert "Segmentation fault" in proc.stderr and "crash_here" in proc.stderr and "Thread 0x" in proc.stderr
