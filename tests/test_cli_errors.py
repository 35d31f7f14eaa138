"""Every mistake is said in one line within seconds: a broker that does not answer, a
missing file, a bad path. The real CLI as a subprocess; no broker needed."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.conftest import rlstream_cmd

DEAD = "127.0.0.1:1"  # nothing listens on port 1


def clean_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(RLSTREAM_HOME=str(tmp_path / "home"), RLSTREAM_RUN_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    return env


def one_line(args: list[str], tmp_path, within_s: float = 25.0) -> tuple[str, float]:
    """Run ``rlstream ARGS``: exit code 2, nothing but one line on the terminal, within ``within_s``."""
    t0 = time.monotonic()
    p = subprocess.run([*rlstream_cmd(), *args], env=clean_env(tmp_path), capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)  # fmt: skip
    took = time.monotonic() - t0
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0] and "%3|" not in lines[0]
    assert took < within_s, f"took {took:.1f} s"
    return lines[0], took


@pytest.mark.parametrize(
    "command", [["status"], ["topics", "create"], ["feed"], ["reward"], ["export", "out"], ["eval", "--latest"]]
)
def test_a_broker_that_does_not_answer_is_one_line_with_the_address_and_what_to_do(command, tmp_path):
    # a 2 s check: the old ~30 s of retries and librdkafka noise cannot pass 25 s even on a loaded machine
    args = ["-s", f"kafka.bootstrap_servers={DEAD}", "-s", "liveness.broker_check_s=2", *command]
    line, _ = one_line(args, tmp_path, within_s=25)
    assert line.startswith("error: BrokerUnreachable: no Kafka broker answers at 127.0.0.1:1 (Connection refused")
    assert "`rlstream broker start`" in line and "kafka.bootstrap_servers" in line


def test_rlstream_run_with_an_unreachable_bootstrap_is_one_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[job]\nname = "t"\n[job.dataset]\ngenerator = "next_digit"\n')
    line, _ = one_line(["run", str(job), "-s", f"kafka.bootstrap_servers={DEAD}"], tmp_path)
    assert "BrokerUnreachable" in line and "127.0.0.1:1" in line and "`rlstream broker start`" in line
    assert not (tmp_path / "runs").exists()  # refused before any work


@pytest.mark.parametrize("command", ["run", "demo"])
def test_a_mistake_is_said_before_the_local_broker_starts(command, tmp_path):
    """No kafka.bootstrap_servers: the checks before start come before the local broker (which
    takes seconds to start, and a download on first use); a mistake starts nothing."""
    job = tmp_path / "job.toml"
    job.write_text('[job]\nname = "t"\n[reward]\ntasks = { next_digit = [{ name = "exact_matc" }] }\n'
                   '[job.dataset]\ngenerator = "next_digit"\n')  # fmt: skip
    args = ["run", str(job)] if command == "run" else ["-c", str(job), "demo"]
    line, took = one_line(args, tmp_path, within_s=60)
    print(f"[preflight] {command} without a broker: {took:.1f} s")
    assert "reward.tasks.next_digit: unknown reward 'exact_matc'" in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home" / "broker").exists()


def test_an_unresolvable_host_says_so(tmp_path):
    line, _ = one_line(["-s", "kafka.bootstrap_servers=no-such-host.invalid:9092", "status"], tmp_path)
    assert "no-such-host.invalid:9092" in line and "`rlstream broker start`" in line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["-c", "missing.toml", "status"], "ConfigError: config file not found"),
        (["eval", "missing.jsonl"], "ConfigError: eval.source missing.jsonl does not exist"),
        (["eval", "missing.jsonl", "--version", "3"], "ConfigError: eval.source missing.jsonl does not exist"),
        (["eval"], "ConfigError: eval.source is not set"),
        (["export", "a-file"], "ConfigError: a-file is a file"),
    ],
)
def test_user_mistakes_are_one_line_without_a_traceback(args, said, tmp_path):
    (tmp_path / "a-file").write_text("")
    line, _ = one_line(["-s", "liveness.broker_check_s=0", *args], tmp_path)  # the mistake, not the broker
    assert said in line, line


def test_librdkafka_lines_go_to_the_python_log_a_repeated_one_once_per_window(caplog):
    """Not raw ``%3|...`` lines on the terminal: every client's ``logger`` is the ``librdkafka``
    Python logger, and a failed reconnect repeated every few ms is written once per window."""
    import logging

    from pipeline.kafka import client_conf
    from pipeline.kafka.common import _RDKAFKA, _RdkafkaLog
    from rlstream.config import load_config

    assert client_conf(load_config(None, [], environ={}), "x")["logger"] is _RDKAFKA
    lg = _RdkafkaLog()
    line = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after {}ms in state CONNECT)"
    with caplog.at_level(logging.INFO, logger="librdkafka"):
        for ms in (0, 1, 2):
            lg.log(logging.ERROR, "%s [%s] %s", "FAIL", "rlstream-x#consumer-1", line.format(ms))
        lg.window_s = 0.0  # the window has passed
        lg.log(logging.ERROR, "%s [%s] %s", "FAIL", "rlstream-x#consumer-1", line.format(5))
    said = [r.getMessage() for r in caplog.records if r.name == "librdkafka"]
    assert len(said) == 2 and said[0].startswith("FAIL [rlstream-x#consumer-1]")
    assert said[1].endswith("(2 more like it since the last one)")
