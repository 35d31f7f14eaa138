"""The CLI itself: fast help without torch, clear config errors."""

import subprocess
import sys


def test_help_does_not_import_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from pipeline.cli import app;"
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output;"
        "bad = [m for m in ('torch', 'transformers', 'deepspeed', 'vllm') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_error_is_one_clear_line():
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "--set", "rollout.max_inflight=0", "config", "show"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert "rollout.max_inflight" in p.stderr and "Traceback" not in p.stderr


def test_config_show_prints_resolved_toml():
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "show", "--set", "rl.max_staleness=5"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "[rl]\nmax_staleness = 5" in p.stdout
