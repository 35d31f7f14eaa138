"""Where the test session's Kafka broker comes from: ``KAFKA_BOOTSTRAP`` if set, else
testcontainers if a Docker engine answers, else the local KRaft broker (started and stopped
by the session, in a temporary directory; ``KAFKA_NODES=3``: a local three-node cluster)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


def _docker_engine_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:  # no client library, no socket, no engine
        return False


@contextlib.contextmanager
def kafka_broker() -> Iterator[tuple[str, str]]:
    """Yield ``(bootstrap, source)`` for the session."""
    if os.environ.get("KAFKA_BOOTSTRAP"):
        yield os.environ["KAFKA_BOOTSTRAP"], "KAFKA_BOOTSTRAP"
        return
    if os.environ.get("RLSTREAM_TEST_DOCKER", "1") != "0" and _docker_engine_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer("apache/kafka:4.1.1").with_kraft() as kc:
            yield kc.get_bootstrap_server(), "testcontainers"
        return
    from rlstream.broker_cluster import local_broker
    from rlstream.config import BrokerConfig

    data = tempfile.mkdtemp(prefix="rlstream-test-broker-")
    nodes = int(os.environ.get("KAFKA_NODES", "1"))
    # groups form at once (no wait for more members: tests start them one by one), as before the
    # local broker's default became 1000 ms
    fast = {"group.initial.rebalance.delay.ms": "0"}
    broker = local_broker(
        BrokerConfig(port=0, data_dir=data, heap_mb=512 if nodes == 1 else 384, nodes=nodes, properties=fast)
    )
    try:
        state = broker.start(progress=lambda m: print(f"[kafka fixture] {m}"), owned=True)
        yield state["bootstrap"], "local broker"
    finally:
        broker.stop(progress=lambda m: print(f"[kafka fixture] {m}"))
        shutil.rmtree(data, ignore_errors=True)


@contextlib.contextmanager
def own_broker(data_dir) -> Iterator[dict]:
    """A local broker of the test's own (its state: ``pid``, ``bootstrap``), for tests that pause it
    (SIGSTOP) and so must not touch the session's broker. Always left running again, then stopped."""
    import signal

    from rlstream.broker import LocalBroker
    from rlstream.config import BrokerConfig

    broker = LocalBroker(BrokerConfig(port=0, data_dir=data_dir, heap_mb=512))
    state = broker.start(progress=lambda _msg: None, owned=True)
    try:
        yield state
    finally:
        try:
            os.kill(state["pid"], signal.SIGCONT)  # never leave it stopped
        except ProcessLookupError:
            pass
        broker.stop(progress=lambda _msg: None)
