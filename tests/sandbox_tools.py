"""``module:function`` tools for the tool-runner tests (``tests.test_tool_sandbox``): one that
answers, one that spins forever, one that allocates without bound, one that ends its process, one
that opens a TCP connection, and one that says which process it runs in. Imports nothing heavy,
so a runner loads it quickly."""

from __future__ import annotations

import os
import socket


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    print("a tool's own print never reaches the model")
    return a + b


def spin(n: int) -> int:
    """Count forever.

    Args:
        n: Where to start.
    """
    while True:
        n += 1


def hog(mb: int) -> int:
    """Allocate memory without bound.

    Args:
        mb: Megabytes per allocation.
    """
    held = []
    while True:
        held.append(bytearray(mb << 20))


def die(code: int) -> int:
    """End the process at once.

    Args:
        code: Its exit code.
    """
    os._exit(code)


def connect(port: int) -> str:
    """Open a TCP connection to 127.0.0.1.

    Args:
        port: The port.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        return "connected"


def pid(x: int) -> int:
    """The id of the process the tool runs in.

    Args:
        x: Ignored.
    """
    return os.getpid()
