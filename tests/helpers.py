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
