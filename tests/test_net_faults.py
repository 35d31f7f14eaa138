"""Network faults through the loopback fault proxy (``rlstream.dev.faultproxy``): bytes pass and are
counted per owning process (found through /proc); a partition holds them and a heal lets them
through; a one-way hold, latency and a reset do what they say. Then a real job against its own
broker behind the proxy: a rollout worker cut off from the broker past its session timeout while it
has samples in flight; after the heal the job finishes and ``rlstream audit`` finds nothing lost
and nothing trained twice."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlstream.dev.faultproxy import FaultProxy
from tests.conftest import REPO, rlstream_cmd, run_cli


def wait_until(cond, timeout: float, what: str, proc=None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} while waiting for {what}:\n{_tail(log)}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{_tail(log)}"
        time.sleep(0.2)


def _tail(path: Path | None, n: int = 6000) -> str:
    try:
        return path.read_text()[-n:] if path else ""
    except OSError:
        return ""


class Echo:
    """A TCP echo server on loopback (the proxy's upstream in the unit tests)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    def _echo(self, c):
        with c:
            try:
                while data := c.recv(65536):
                    self.received += len(data)
                    c.sendall(data)
            except OSError:
                return  # reset by the proxy

    def close(self):
        self.sock.close()


@pytest.fixture
def echo_proxy():
    echo = Echo()
    me = os.getpid()
    proxy = FaultProxy(("127.0.0.1", echo.port), identify=lambda pid: "me" if pid == me else None)
    try:
        yield echo, proxy
    finally:
        proxy.close()
        echo.close()


def _client(proxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    s.settimeout(10)
    return s


def _recv(s: socket.socket, n: int, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while len(out) < n:
            chunk = s.recv(n - len(out))
            if not chunk:
                break
            out += chunk
    except TimeoutError:
        pass
    return out


def test_bytes_pass_and_each_connection_is_named_by_its_process(echo_proxy):
    _, proxy = echo_proxy
    with _client(proxy) as s:
        s.sendall(b"hello" * 1000)
        assert _recv(s, 5000, 10) == b"hello" * 1000
        conns = proxy.connections()
        assert len(conns) == 1 and conns[0]["owner"] == "me" and conns[0]["pid"] == os.getpid(), conns
        # each direction's count is added after its bytes are forwarded: wait for both
        wait_until(lambda: (c := proxy.connections()[0])["up"] == c["down"] == 5000, 10, "the count of bytes forwarded")


def test_a_partition_holds_bytes_both_ways_and_the_heal_lets_them_through(echo_proxy):
    echo, proxy = echo_proxy
    with _client(proxy) as s:
        s.sendall(b"a")
        assert _recv(s, 1, 10) == b"a"
        other = proxy.fault("partition", ["someone-else"])  # another role's fault: ours still passes
        s.sendall(b"b")
        assert _recv(s, 1, 10) == b"b"
        proxy.clear(other)
        rule = proxy.fault("partition", ["me"])
        s.sendall(b"held")
        assert _recv(s, 4, 1.5) == b"" and echo.received == 2  # the broker side got nothing either
        with _client(proxy) as s2:  # a new connection is accepted, then hangs
            s2.sendall(b"new")
            assert _recv(s2, 3, 1.0) == b""
            proxy.clear(rule)
            assert _recv(s, 4, 10) == b"held"
            assert _recv(s2, 3, 10) == b"new"
    assert proxy.fault("partition", "me", seconds=0.5).until is not None
    with _client(proxy) as s:  # a timed fault ends by itself
        s.sendall(b"later")
        assert _recv(s, 5, 15) == b"later"


def test_a_one_way_hold_latency_and_a_reset(echo_proxy):
    echo, proxy = echo_proxy
    with _client(proxy) as s:
        rule = proxy.fault("hold", ["me"], direction="down")
        s.sendall(b"x")
        wait_until(lambda: echo.received == 1, 10, "the bytes to reach the server")
        assert _recv(s, 1, 1.0) == b""  # ...but not its answer
        proxy.clear(rule)
        assert _recv(s, 1, 10) == b"x"
        rule = proxy.fault("latency", ["me"], delay_s=0.3, jitter_s=0.05)
        t0 = time.monotonic()
        s.sendall(b"y")
        assert _recv(s, 1, 10) == b"y"
        assert time.monotonic() - t0 >= 0.5  # 0.3 +- 0.05 s each way
        proxy.clear(rule)
        proxy.fault("reset", ["me"])
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            for _ in range(50):  # the RST arrives asynchronously
                s.sendall(b"z")
                if s.recv(1) == b"":
                    raise ConnectionResetError("closed")
                time.sleep(0.1)
    assert proxy.connections() == []
    with pytest.raises(ValueError, match="direction"):
        proxy.fault("hold", ["me"])


CHATTY = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
while True:
    s.sendall(b"x")
    s.recv(1)
    time.sleep(0.05)
"""


def test_the_net_fault_class_partitions_a_supervised_role_and_heals_it(tmp_path):
    """``NetFaults`` in front of a stand-in broker (an echo server): its plan, then a partition of
    ``rollout-0`` (a supervised process, named through the supervisor) that stops its bytes until
    ``poll`` ends it, recorded in ``done``."""
    import random
    import sys
    from types import SimpleNamespace

    from rlstream.config import load_config
    from rlstream.dev.chaos_net import NetFaults, front
    from rlstream.dev.chaos_plan import Fault
    from rlstream.supervisor import RestartPolicy, Supervisor

    echo = Echo()
    (tmp_path / "server.properties").write_text(f"listeners=PLAINTEXT://127.0.0.1:{echo.port}\n")
    broker = SimpleNamespace(cfg=SimpleNamespace(host="127.0.0.1"), data_dir=tmp_path, advertised_port=None)
    proxy = front(broker)
    assert broker.advertised_port == proxy.port
    cfg = load_config(None, ["rollout.session_timeout_ms=6000"], environ={})
    said: list[str] = []
    try:
        with Supervisor(tmp_path / "logs", restart=RestartPolicy(backoff_s=0.2)) as sup:
            ctx = SimpleNamespace(cfg=cfg, launcher=SimpleNamespace(sup=sup, progress=None), run_dir=None,
                                  broker_ops=SimpleNamespace(broker=broker), say=said.append, rng=None)  # fmt: skip
            nf = NetFaults(ctx)
            plan = nf.plan({"partitions": 2, "net_latency": 1}, random.Random(1), 100.0)
            parts = [f for f in plan if f.kind == "partition"]
            assert [f.target for f in parts] == ["rollout-0", "rollouts"] and len(plan) == 3
            assert parts[0].arg > 6 > parts[1].arg
            sup.start("rollout-0", [sys.executable, "-c", CHATTY, str(proxy.port)])

            def sent() -> int:
                return sum(c["up"] for c in proxy.connections() if c["owner"] == "rollout-0")

            wait_until(lambda: sent() > 5, 60, "rollout-0's bytes through the proxy")
            f = Fault(0.0, "partition", "rollout-0", arg=3.0)
            assert nf.do(f, 0.0).startswith("network partition of rollout-0") and nf.busy
            time.sleep(0.5)  # a byte already on its way passes
            held = sent()
            time.sleep(1.5)
            assert sent() == held
            nf.poll(1.0)
            assert nf.busy
            nf.poll(3.1)
            assert not nf.busy and f.outcome.startswith("partition of rollout-0 ended")
            wait_until(lambda: sent() > held + 3, 30, "rollout-0's bytes to pass again")
            assert nf.done[0]["kind"] == "partition" and nf.done[0]["seconds"] == 3.1
            lat = Fault(4.0, "latency", "rollout-0", arg=2.0)
            assert nf.do(lat, 4.0).startswith("network latency 200 +- 100 ms per round trip for rollout-0")
            assert [r.kind for r in proxy.faults] == ["latency"]
            nf.poll(6.5)
            assert proxy.faults == [] and lat.outcome.startswith("latency of rollout-0 ended")
            assert (
                nf.do(Fault(7.0, "reset", "rollout-0", arg=0.0), 7.0)
                == "reset 1 connection(s) of rollout-0 to the broker"
            )
            wait_until(lambda: not any(c["owner"] == "rollout-0" for c in proxy.connections()), 30, "the reset")
            nf.poll(7.1)
            assert [d["kind"] for d in nf.done] == ["partition", "latency", "reset"]
            nf.do(Fault(8.0, "partition", "rollout-0", arg=60.0), 8.0)
            nf.close()  # the harness exits: nothing stays cut off
            assert not nf.busy and proxy.faults == []
    finally:
        proxy.close()
        echo.close()


# ---- a partitioned rollout worker in a real job ------------------------------------------------
JOB = REPO / "examples/next-digit.toml"
SESSION_MS = 6000
STEPS = 300
"""At k = 0 (each step waits for the one before: ~0.15 s a step here) the job outlasts the
partition (the session timeout and 4 s) and the heal, however fast the machine."""


def _roles(events: Path) -> dict[int, str]:
    """pid -> role name, from the job supervisor's events (start and restart)."""
    out = {}
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line being written
        if e.get("event") in ("start", "restart") and e.get("pid"):
            out[int(e["pid"])] = e["name"]
    return out


def _steps(job_dir: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in job_dir.rglob("steps.jsonl"))


@pytest.mark.kafka
@pytest.mark.slow
def test_a_rollout_worker_partitioned_past_its_session_loses_and_duplicates_nothing(tmp_path):
    from rlstream.broker import LocalBroker
    from rlstream.config import BrokerConfig
    from rlstream.dev.chaos_net import front

    broker = LocalBroker(BrokerConfig(port=0, data_dir=tmp_path / "broker", heap_mb=384))
    proxy = front(broker)
    name = f"nf{uuid.uuid4().hex[:8]}"
    job_dir = tmp_path / "runs" / name
    events = job_dir / "logs" / "events.jsonl"
    proxy.identify = lambda pid: _roles(events).get(pid)
    job = None
    try:
        bootstrap = broker.start(progress=print, owned=True)["bootstrap"]
        assert bootstrap == proxy.address
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
        env.update(RLSTREAM_KAFKA__BOOTSTRAP_SERVERS=bootstrap, RLSTREAM_RUN_DIR=str(tmp_path / "runs"),
                   RLSTREAM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")  # fmt: skip
        sets = [f"job.name={name}", "rl.max_staleness=0", "rollout.max_inflight=32",
                f"rollout.session_timeout_ms={SESSION_MS}", f"reward.session_timeout_ms={SESSION_MS}"]  # fmt: skip
        out = tmp_path / "job.out"
        with open(out, "wb") as fh:
            job = subprocess.Popen(
                [*rlstream_cmd(), "run", str(JOB), "--steps", str(STEPS), "--no-live", *(x for s in sets for x in ("--set", s))],
                env=env, stdout=fh, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until(lambda: _steps(job_dir) >= 2, 300, "the job's first steps", job, out)
        assert any(c["owner"] == "rollout-0" for c in proxy.connections()), proxy.connections()
        r0 = job_dir / "logs" / "rollout-0.log"
        rule = proxy.fault("partition", ["rollout-0"])
        t0 = time.monotonic()
        try:  # its session times out: the group drops it, rollout-1 takes its partitions and prompts
            wait_until(lambda: "partitions lost" in r0.read_text(), 120, "rollout-0 to lose its partitions", job, r0)
            assert _steps(job_dir) < STEPS, "the job ended before the partition took effect"
            time.sleep(max(0.0, SESSION_MS / 1000 + 4 - (time.monotonic() - t0)))  # the fault is this long
        finally:
            proxy.clear(rule)
        paused_s = time.monotonic() - t0
        healed = sum(c["up"] for c in proxy.connections() if c["owner"] == "rollout-0")
        wait_until(lambda: sum(c["up"] for c in proxy.connections() if c["owner"] == "rollout-0") > healed + 10_000,
                   120, "rollout-0 back at work after the heal", job, r0)  # fmt: skip
        t_fault = time.time() - paused_s
        assert job.wait(600) == 0, _tail(out)
        said = _tail(r0, 400_000)
        print(f"partitioned {paused_s:.1f} s; rollout-0 said:")
        for line in said.splitlines():
            if any(
                m in line for m in ("lost", "revoked", "fenced", "commit", "timed out", "assigned", "fault", "paused")
            ):
                print("  ", line[:300])
        times = sorted(json.loads(x)["time"] for p in job_dir.rglob("steps.jsonl") for x in p.read_text().splitlines())
        gap, at = max((b - a, a - t_fault) for a, b in itertools.pairwise(times))
        during = sum(1 for x in times if t_fault <= x <= t_fault + paused_s)
        print(
            f"{during} steps during the partition; longest gap between steps {gap:.1f} s, from {at:.1f} s after it began"
        )
        audit = run_cli(["audit", name, "--bootstrap", bootstrap, "--json"], env, timeout=300, check=False)
        assert audit.returncode == 0, audit.stdout + audit.stderr
        report = json.loads(audit.stdout)
        a = report["audit"]
        print(report["line"], "dead letters:", a["dlq_by_role"], a["dlq_by_error_type"])
        assert report["verdict"] == "PASS" and a["steps"] == STEPS, report["line"]
        assert report["counts"]["lost"] == 0 and report["counts"]["trained_twice"] == 0, report["line"]
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(60)
        broker.stop(progress=print)
        proxy.close()
