"""Shared fixtures. Tests marked ``kafka`` get a real broker for the whole session."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.topology import RunIdentity
from tests.kafka_fixture import kafka_broker

REPO = Path(__file__).resolve().parents[1]
_NODES = int(os.environ.get("KAFKA_NODES", "1"))
CLUSTER_TOPICS = (
    {"topics.replication_factor": str(min(3, _NODES)), "topics.min_insync_replicas": str(min(2, _NODES))}
    if _NODES > 1 and not os.environ.get("KAFKA_BOOTSTRAP")
    else {}
)
"""On the local cluster of ``KAFKA_NODES`` > 1 (tests/kafka_fixture.py), topics are replicated
like the cluster's own (a topic with fewer replicas than the broker's min.insync.replicas refuses
acks=all writes); a test's own ``--set`` wins."""


@pytest.fixture(scope="session")
def kafka_bootstrap():
    with kafka_broker() as (bootstrap, source):
        print(f"[kafka fixture] using {bootstrap} from {source}")
        yield bootstrap
        # Clients kept alive by reference cycles (e.g. a worker held by a test's traceback) must be
        # destroyed while the broker still runs, or librdkafka keeps reconnecting after the session.
        gc.collect()


@pytest.fixture
def topic_prefix() -> str:
    """A prefix unique to the test, so tests sharing the broker never see each other's data.
    ``make_config`` and ``cli_env`` name the test's consumer groups and transactional ids after it
    too (``RunIdentity.of_prefix``): a group shared between tests kept the earlier test's static
    members, whose old assignment a later test's member with the same instance id was handed."""
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def make_config(kafka_bootstrap, topic_prefix, tmp_path):
    """Build a root Config pointed at the test broker, with unique topics. Extra ``--set`` items
    may be given. ``create=True`` creates the topics."""
    from pipeline.admin import ensure_topics
    from rlstream.config import load_config

    def make(*overrides: str, create: bool = True):
        cfg = load_config(
            None,
            [
                f"kafka.bootstrap_servers={kafka_bootstrap}",
                *(f"{k}={v}" for k, v in RunIdentity.of_prefix(topic_prefix).settings().items()),
                f"run_dir={tmp_path / 'runs'}",
                *(f"{k}={v}" for k, v in CLUSTER_TOPICS.items()),
                *overrides,
            ],
            environ={},
        )
        if create:
            ensure_topics(cfg)
        return cfg

    return make


@pytest.fixture
def cli_env(kafka_bootstrap, topic_prefix, tmp_path) -> dict[str, str]:
    """Environment for running the real ``rlstream`` CLI as a subprocess against the test broker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(
        RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        **env_vars(RunIdentity.of_prefix(topic_prefix).settings()),
        RLSTREAM_RUN_DIR=str(tmp_path / "runs"),
        RLSTREAM_HOME=str(tmp_path / "home"),
        PYTHONUNBUFFERED="1",
        **env_vars(CLUSTER_TOPICS),
    )
    return env


def env_vars(settings: dict[str, str]) -> dict[str, str]:
    """Dotted settings as the environment variables a role reads (``a.b_c`` -> ``RLSTREAM_A__B_C``)."""
    return {"RLSTREAM_" + k.upper().replace(".", "__"): v for k, v in settings.items()}


def rlstream_cmd() -> list[str]:
    return [sys.executable, "-m", "rlstream"]


def run_cli(args: list[str], env: dict[str, str], timeout: float = 120, check: bool = True):
    proc = subprocess.run([*rlstream_cmd(), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlstream {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
