"""Which prompt offsets a rollout worker may commit.

Every consumed prompt message is entered with the number of broker acknowledgements it still
needs (one per trajectory it asks for, or one for its dead letter). A held message (admission
control) is entered too, so nothing after it can be committed. Delivery callbacks count the
acknowledgements down; ``committable`` returns, per partition, the offset after the longest
prefix of messages that are fully acknowledged. Commits therefore happen in offset order and
only after ALL trajectories of a message are on the broker: a crash loses no prompt.

What this is not: a Kafka client; the worker commits what this returns.
"""

from __future__ import annotations

from collections import OrderedDict

from pipeline.kafka import TopicPartition

TP = tuple[str, int]


class OffsetLedger:
    def __init__(self):
        self.parts: dict[TP, OrderedDict[int, int]] = {}
        self.committed: dict[TP, int] = {}
        self.generation: dict[TP, int] = {}
        self.last: dict[TP, int] = {}

    def rewound(self, tp: TP, offset: int) -> bool:
        """True if ``offset`` is not after the last offset entered for ``tp`` (a re-delivery from an
        earlier position: the caller starts the partition over with ``drop``)."""
        return offset <= self.last.get(tp, -1)

    def add(self, tp: TP, offset: int, acks: int) -> int:
        """Track message ``offset`` of ``tp``, which is done after ``acks`` acknowledgements.
        Returns the partition's generation, to pass to ``ack``."""
        part = self.parts.setdefault(tp, OrderedDict())
        if part and offset <= next(reversed(part)):
            raise ValueError(f"offset {offset} of {tp} is not after {next(reversed(part))}")
        part[offset] = acks
        self.last[tp] = offset
        return self.generation.get(tp, 0)

    def ack(self, tp: TP, offset: int, generation: int, n: int = 1) -> None:
        part = self.parts.get(tp)
        if part is None or offset not in part or generation != self.generation.get(tp, 0):
            return  # the partition was revoked or lost meanwhile: its state was dropped
        part[offset] -= n
        if part[offset] < 0:
            raise AssertionError(f"more acknowledgements than expected for {tp}@{offset}")

    def outstanding(self, tps: set[TP] | None = None) -> int:
        """Messages not yet fully acknowledged (of ``tps``, or all)."""
        return sum(1 for tp, part in self.parts.items() if tps is None or tp in tps for a in part.values() if a > 0)

    def committable(self, tps: set[TP] | None = None) -> list[TopicPartition]:
        """Offsets to commit now (and forget the messages they cover)."""
        out = []
        for tp, part in self.parts.items():
            if tps is not None and tp not in tps:
                continue
            last = None
            while part:
                off, acks = next(iter(part.items()))
                if acks > 0:
                    break
                part.popitem(last=False)
                last = off
            if last is not None and self.committed.get(tp, -1) < last + 1:
                self.committed[tp] = last + 1
                out.append(TopicPartition(tp[0], tp[1], last + 1))
        return out

    def drop(self, tps) -> None:
        """Forget partitions (revoked or lost)."""
        for tp in tps:
            self.parts.pop(tp, None)
            self.committed.pop(tp, None)
            self.last.pop(tp, None)
            self.generation[tp] = self.generation.get(tp, 0) + 1
