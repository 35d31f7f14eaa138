"""A loopback TCP proxy that injects network faults between the roles and a local broker, per role.

``FaultProxy`` listens on ``127.0.0.1`` and forwards each connection to the broker (``upstream``:
``(host, port)`` or a callable giving it at each connection, so a restarted broker on another port
is followed). The broker advertises the proxy's port (``LocalBroker.advertised_port``), so every
client connection, the bootstrap one and those learned from metadata, passes through it.

Each accepted connection is attributed to the process that opened it (on loopback: its peer port ->
the socket's inode in ``/proc/net/tcp`` -> the ``/proc/<pid>/fd`` that holds it) and ``identify(pid)``
names it (a role name from the supervisor); a process the callback does not know is looked up
through its parents. Faults (``fault``) apply to the connections of a set of names (``targets``) or
to all (``None``), for ``seconds`` or until ``clear``:

* ``partition``: no byte passes either way; connections stay open, new ones are accepted and hang;
* ``hold``: one-way loss, the bytes of one ``direction`` (``up``: client -> broker, ``down``:
  broker -> client) are held (TCP back-pressure keeps them in the kernel's buffers);
* ``latency``: each chunk waits ``delay_s`` +- ``jitter_s`` before it is forwarded, each way;
* ``bandwidth``: at most ``bytes_per_s`` per connection and direction;
* ``reset``: the matching connections are closed with an RST now, and, for ``seconds``, new ones too.

Threads: one accept thread, two pump threads per connection; every wait is bounded (0.25 s) and
woken by fault changes; ``close`` ends them all. What this is not: a general proxy (one upstream,
loopback only), nor the fault schedule (``rlstream.dev.chaos_net``).
"""

from __future__ import annotations

import logging
import os
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.log import kv

log = logging.getLogger(__name__)

KINDS = ("partition", "hold", "latency", "bandwidth", "reset")
WAIT_S = 0.25
"""The longest any proxy thread waits before it looks at its state again."""
CHUNK = 65536


@dataclass
class Rule:
    """One fault in force."""

    kind: str
    targets: frozenset[str] | None
    """The names of the processes whose connections it strikes; None: every connection."""
    until: float | None
    """``time.monotonic()`` it ends at; None: until cleared."""
    direction: str | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    bytes_per_s: float = 0.0

    def matches(self, owner: str | None) -> bool:
        return self.targets is None or owner in self.targets

    def live(self, now: float) -> bool:
        return self.until is None or now < self.until


@dataclass
class _Conn:
    client: socket.socket
    peer: tuple[str, int]
    opened: float
    upstream: socket.socket | None = None
    pid: int | None = None
    owner: str | None = None
    sent: dict = field(default_factory=lambda: {"up": 0, "down": 0})
    closed: bool = False

    def info(self) -> dict:
        return {"owner": self.owner, "pid": self.pid, "peer": self.peer[1], "opened": self.opened, **self.sent}


class FaultProxy:
    def __init__(
        self,
        upstream: tuple[str, int] | Callable[[], tuple[str, int]],
        host: str = "127.0.0.1",
        port: int = 0,
        identify: Callable[[int], str | None] | None = None,
        connect_timeout_s: float = 5.0,
    ):
        self.upstream, self.host, self.identify = upstream, host, identify
        self.connect_timeout_s = connect_timeout_s
        self._sock = socket.create_server((host, port))
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._rules: list[Rule] = []
        self._conns: list[_Conn] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._rng = random.Random(self.port)
        self._accept = threading.Thread(target=self._accept_loop, name=f"faultproxy-{self.port}", daemon=True)
        self._accept.start()
        log.info("fault proxy listening %s", kv(address=self.address))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- faults ----------------------------------------------------------------------------------
    def fault(
        self,
        kind: str,
        targets=None,
        seconds: float | None = None,
        *,
        direction: str | None = None,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        bytes_per_s: float = 0.0,
    ) -> Rule:
        """Put a fault in force (see the module docstring); the rule, for ``clear``."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")
        if kind == "hold" and direction not in ("up", "down"):
            raise ValueError("a hold fault needs direction 'up' (client -> broker) or 'down' (broker -> client)")
        if kind == "bandwidth" and bytes_per_s <= 0:
            raise ValueError("a bandwidth fault needs bytes_per_s > 0")
        if isinstance(targets, str):
            targets = [targets]
        until = None if seconds is None else time.monotonic() + seconds
        rule = Rule(kind, None if targets is None else frozenset(targets), until, direction, delay_s, jitter_s,
                    bytes_per_s)  # fmt: skip
        with self._cond:
            self._rules.append(rule)
            self._cond.notify_all()
        if kind == "reset":
            for c in self.connections_of(rule):
                self._reset(c)
        log.info("fault proxy fault %s", kv(kind=kind, targets=sorted(targets or ["*"]), seconds=seconds))
        return rule

    def clear(self, rule: Rule | None = None) -> None:
        """End ``rule`` (None: every fault) now."""
        with self._cond:
            self._rules = [] if rule is None else [r for r in self._rules if r is not rule]
            self._cond.notify_all()

    @property
    def faults(self) -> list[Rule]:
        now = time.monotonic()
        with self._cond:
            return [r for r in self._rules if r.live(now)]

    def connections(self) -> list[dict]:
        """The open connections: owner, pid, peer port, open time and bytes each way."""
        with self._cond:
            return [c.info() for c in self._conns if not c.closed]

    def connections_of(self, rule: Rule) -> list[_Conn]:
        with self._cond:
            return [c for c in self._conns if not c.closed and rule.matches(c.owner)]

    def _effect(self, owner: str | None, direction: str) -> tuple[bool, float, float]:
        """(held, delay before forwarding a chunk, bytes/s limit or 0) for one connection and direction."""
        now, held, delay, rate = time.monotonic(), False, 0.0, 0.0
        with self._cond:
            rules = [r for r in self._rules if r.live(now) and r.matches(owner)]
        for r in rules:
            if r.kind == "partition" or (r.kind == "hold" and r.direction == direction):
                held = True
            elif r.kind == "latency":
                delay = max(delay, max(0.0, r.delay_s + self._rng.uniform(-r.jitter_s, r.jitter_s)))
            elif r.kind == "bandwidth":
                rate = r.bytes_per_s if not rate else min(rate, r.bytes_per_s)
        return held, delay, rate

    # -- connections -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], WAIT_S)
            except (OSError, ValueError):  # closed under us by ``close``
                return
            if ready:
                try:
                    client, peer = self._sock.accept()
                except (BlockingIOError, OSError):
                    continue
                c = _Conn(client, peer, time.time())
                self._spawn(self._serve, c, f"faultproxy-conn-{peer[1]}")
            with self._cond:  # prune: ended faults and closed connections
                now = time.monotonic()
                self._rules = [r for r in self._rules if r.live(now)]
                self._conns = [c for c in self._conns if not c.closed]
                self._threads = [t for t in self._threads if t.is_alive()]

    def _spawn(self, fn, arg, name: str) -> None:
        t = threading.Thread(target=fn, args=(arg,), name=name, daemon=True)
        with self._cond:
            self._threads.append(t)
        t.start()

    def _serve(self, c: _Conn) -> None:
        c.pid = owner_pid(c.peer[1], self.port)
        c.owner = self._name(c.pid)
        with self._cond:
            self._conns.append(c)
            reset = any(r.kind == "reset" and r.live(time.monotonic()) and r.matches(c.owner) for r in self._rules)
        if reset or self._stop.is_set():
            self._reset(c)
            return
        try:
            host, port = self.upstream() if callable(self.upstream) else self.upstream
            c.upstream = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except (OSError, TypeError) as exc:  # the broker is down (a restart): the client reconnects
            log.debug("fault proxy cannot reach the broker %s", kv(owner=c.owner, error=exc))
            self._close(c)
            return
        for s in (c.client, c.upstream):
            s.settimeout(WAIT_S)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._spawn(self._pump_down, c, f"faultproxy-down-{c.peer[1]}")
        self._pump(c, c.client, c.upstream, "up")

    def _pump_down(self, c: _Conn) -> None:
        self._pump(c, c.upstream, c.client, "down")

    def _pump(self, c: _Conn, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while not c.closed and not self._stop.is_set():
            held, delay, rate = self._effect(c.owner, direction)
            if held:  # nothing is read: the sender's bytes wait in the kernel's buffers
                with self._cond:
                    self._cond.wait(WAIT_S)
                continue
            try:
                ready, _, _ = select.select([src], [], [], WAIT_S)
                if not ready:
                    continue
                data = src.recv(min(CHUNK, max(1, int(rate / 10))) if rate else CHUNK)
            except (OSError, ValueError):
                break
            if not data:
                break
            held, delay, rate = self._effect(c.owner, direction)
            while held and not c.closed and not self._stop.is_set():  # a fault that began meanwhile
                with self._cond:
                    self._cond.wait(WAIT_S)
                held, delay, rate = self._effect(c.owner, direction)
            if delay and self._stop.wait(delay):
                break
            if rate and self._stop.wait(len(data) / rate):
                break
            if not self._send(c, dst, data):
                break
            c.sent[direction] += len(data)
        self._close(c)

    def _send(self, c: _Conn, dst: socket.socket, data: bytes) -> bool:
        view = memoryview(data)
        while view and not c.closed and not self._stop.is_set():
            try:
                view = view[dst.send(view) :]
            except TimeoutError:
                continue
            except OSError:
                return False
        return not view

    def _name(self, pid: int | None) -> str | None:
        """The name ``identify`` gives ``pid`` or, failing that, its nearest named parent."""
        if self.identify is None:
            return None
        for _ in range(8):
            if pid is None or pid <= 1:
                return None
            try:
                name = self.identify(pid)
            except Exception as exc:  # a bad callback must not kill the proxy: the connection is unnamed
                log.warning("fault proxy cannot name a process %s", kv(pid=pid, error=exc))
                return None
            if name is not None:
                return name
            pid = _ppid(pid)
        return None

    def _reset(self, c: _Conn) -> None:
        """Close both sides with an RST (SO_LINGER 0)."""
        for s in (c.client, c.upstream):
            if s is not None:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass  # already closed: nothing to reset
        self._close(c)

    def _close(self, c: _Conn) -> None:
        c.closed = True
        for s in (c.client, c.upstream):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass  # closing twice (both pumps end) is harmless
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and end every thread (within ``timeout``)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass  # already closed
        with self._cond:
            conns, threads = list(self._conns), list(self._threads)
            self._cond.notify_all()
        for c in conns:
            self._close(c)
        deadline = time.monotonic() + timeout
        for t in [self._accept, *threads]:
            t.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in [self._accept, *threads] if t.is_alive()]
        if left:
            log.warning("fault proxy threads still running after close %s", kv(threads=left[:5], count=len(left)))
        log.info("fault proxy closed %s", kv(address=self.address))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- which process owns a loopback connection ---------------------------------------------------
def socket_inode(local_port: int, remote_port: int) -> int | None:
    """The inode of the TCP socket at ``local_port`` connected to ``remote_port`` (IPv4 or IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and int(f[1].rsplit(":", 1)[1], 16) == local_port:
                        if int(f[2].rsplit(":", 1)[1], 16) == remote_port and f[9] != "0":
                            return int(f[9])
        except OSError:
            continue
    return None


def pid_of_inode(inode: int) -> int | None:
    """The process holding socket ``inode`` (the lowest pid if several share it), or None."""
    target = f"socket:[{inode}]"
    for entry in sorted((e for e in os.listdir("/proc") if e.isdigit()), key=int):
        fd_dir = f"/proc/{entry}/fd"
        try:
            for fd in os.listdir(fd_dir):
                try:
                    if os.readlink(f"{fd_dir}/{fd}") == target:
                        return int(entry)
                except OSError:
                    continue
        except OSError:  # the process ended, or is not ours to read
            continue
    return None


def owner_pid(peer_port: int, proxy_port: int) -> int | None:
    """The process on this machine that opened the connection from ``peer_port`` to ``proxy_port``."""
    inode = socket_inode(peer_port, proxy_port)
    return None if inode is None else pid_of_inode(inode)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
