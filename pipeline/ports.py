"""Local ports and processes: a free TCP port, whether a port answers, whether a PID lives.
Used by the local broker, distributed launchers and tests. Nothing here talks Kafka."""

from __future__ import annotations

import os
import socket
from collections.abc import Collection


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port nobody listens on right now (the OS picks it), none of ``avoid``: ports picked
    earlier and not yet bound, which the OS may hand out again."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
