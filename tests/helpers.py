"""Small test helpers shared by several test modules."""

from __future__ import annotations


def murmur2_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner (Java ``Utils.murmur2``), written from its description."""
    m, r, mask = 0x5BD1E995, 24, 0xFFFFFFFF
    n = len(key)
    h = (0x9747B28C ^ n) & mask
    for i in range(0, n - n % 4, 4):
        k = int.from_bytes(key[i : i + 4], "little")
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    tail = n % 4
    base = n - tail
    if tail == 3:
        h ^= key[base + 2] << 16
    if tail >= 2:
        h ^= key[base + 1] << 8
    if tail >= 1:
        h ^= key[base]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def free_port_block(width: int) -> int:
    """A base port with ``width`` ports from it free on every interface,
    chosen below the kernel's ephemeral range: a port in that range can be taken at any moment by
    an outgoing connection (a Kafka client's), and a role that then binds it dies with EADDRINUSE."""
    import random
    import socket
    from pathlib import Path

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = min(low, 65000) - width
    for _ in range(200):
        base = random.randrange(10_000, top)
        try:
            for port in range(base, base + width):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports below the ephemeral range")
