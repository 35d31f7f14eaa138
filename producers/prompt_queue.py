"""The rollout worker's prompt queue: consumed, not yet admitted prompt messages, one FIFO per
partition, bounded by ``rollout.queue_samples``.

Why a queue and not pausing: librdkafka drops a paused partition's fetched messages and a resume
waits for a new fetch, so a worker that paused whenever it was full kept its slots waiting on the
broker (docs/results/performance.md). The worker pauses only a partition whose share of the queue is full;
a partition with nothing queued always takes a message, so inadmissible groups queued from one
partition never keep another partition's admissible ones out. Admission takes the oldest
admissible group at the heads, since an old group that waits holds the trainer back and grows
staler; within a partition, offset order is kept (commits follow it).

Bookkeeping only: no Kafka, no engine. Not the offset ledger (``ledger.py``): a queued message is
already in the ledger, and blocks commits past it until its samples are published.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

TP = tuple[str, int]
Entry = tuple[int, dict, int]
"""(offset, decoded prompt, ledger generation) of one queued message."""


class PromptQueue:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        """Most samples queued in all (a consume may overshoot it by a message or a share)."""
        self._q: dict[TP, deque[Entry]] = {}
        self._n: dict[TP, int] = {}
        """Samples queued per partition, kept with ``_q`` (read on every loop of the worker)."""

    def __bool__(self) -> bool:
        return bool(self._q)

    def __len__(self) -> int:
        return sum(len(q) for q in self._q.values())

    def push(self, tp: TP, offset: int, prompt: dict, gen: int) -> None:
        self._q.setdefault(tp, deque()).append((offset, prompt, gen))
        self._n[tp] = self._n.get(tp, 0) + prompt["sample_count"]

    def samples(self, tp: TP | None = None) -> int:
        return sum(self._n.values()) if tp is None else self._n.get(tp, 0)

    def full(self, assigned: Iterable[TP]) -> set[TP]:
        """The assigned partitions to pause: those holding their share of ``limit`` or more."""
        assigned = list(assigned)
        share = self.limit / max(1, len(assigned))
        return {tp for tp in assigned if tp in self._q and self._n[tp] >= share}

    def room(self, per_message: float) -> int:
        """Messages of ``per_message`` samples that still fit."""
        left = self.limit - self.samples()
        return -(-left // max(1, round(per_message))) if left > 0 else 0

    def heads(self) -> list[dict]:
        return [q[0][1] for q in self._q.values()]

    def pop_oldest(self, admissible: Callable[[dict], bool]) -> tuple[TP, Entry] | None:
        """Remove and return the admissible head with the lowest group_seq, or None."""
        heads = [(q[0][1]["group_seq"], tp) for tp, q in self._q.items() if admissible(q[0][1])]
        if not heads:
            return None
        tp = min(heads)[1]
        q = self._q[tp]
        entry = q.popleft()
        self._n[tp] -= entry[1]["sample_count"]
        if not q:
            del self._q[tp], self._n[tp]
        return tp, entry

    def waiting(self, admissible: Callable[[dict], bool]) -> int:
        """Messages of the partitions whose head may not start yet (the ``held_messages`` gauge)."""
        return sum(len(q) for q in self._q.values() if not admissible(q[0][1]))

    def drop(self, pred: Callable[[TP], bool]) -> None:
        """Forget the partitions matching ``pred`` (revoked, lost, rewound): their next owner, or
        the re-delivery, has the messages."""
        for tp in [tp for tp in self._q if pred(tp)]:
            del self._q[tp], self._n[tp]
