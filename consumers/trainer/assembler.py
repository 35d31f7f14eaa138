"""Group assembly and exactly-once bookkeeping of consumed offsets. Pure Python, no Kafka calls.

``GroupAssembler`` collects the samples of each prompt group (``TrainSample.prompt_group``, the
records' ``group_id``) until the group is complete (it has ``group_size`` samples) or its timeout
passes. A trainer step takes G closed groups, oldest
first: lowest ``group_seq`` (the feed's numbering, which admission control counts in; -1, unknown,
counts as oldest), then lowest ``version_min``, then closing order. With a backlog spread over
partitions the consumer sees one partition's records before the other's; FIFO by closing order
would let older groups go stale behind newer ones, while seq order trains group g at version
~ g // G, the version admission planned for it. A sample
of a group that is already closed (late) or a repeated ``trajectory_id`` (duplicate) is refused.
Dynamic sampling removes uninformative closed groups from the queue (``filter_ready``); they are
remembered like trained ones, so a late sample of one is refused too. Which closed groups a step
takes is ``selection.py``'s choice: ``take`` (the oldest n, the live default) or ``take_ids``. A
replay schedule names each group's members (``expect``): such a group closes once it has exactly
those samples (and only then; no timeout), and a sample outside them is refused as late.

``OffsetTracker`` is the resume rule. A record is *disposed* once its fate is final: used in (or
dropped by) a finished trainer step, or refused (late, duplicate, undecodable). Per partition it
keeps ``floor`` = the lowest offset read but not disposed (or the next offset to read when none
is pending) and the disposed offsets at or above the floor. A checkpoint stores exactly that; a
restart seeks every partition to its floor and skips the disposed offsets above it, so samples
of groups that were still assembling (or queued) at the checkpoint are read again and every
record reaches exactly one finished step.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field


class OffsetTracker:
    def __init__(self, state: dict | None = None):
        self.read_pos: dict[int, int] = {}
        self.pending: dict[int, set[int]] = defaultdict(set)
        self.done: dict[int, set[int]] = defaultdict(set)
        for p, st in (state or {}).items():
            self.read_pos[int(p)] = int(st["floor"])
            self.done[int(p)] = set(int(o) for o in st["done"])

    def start_offsets(self) -> dict[int, int]:
        """Where to seek each partition named in the restored state."""
        return dict(self.read_pos)

    def seen(self, partition: int, offset: int) -> bool:
        """Record a read. True if the record was already disposed (skip it), else it is pending."""
        self.read_pos[partition] = max(self.read_pos.get(partition, 0), offset + 1)
        if offset in self.done[partition] or offset in self.pending[partition]:
            return True
        self.pending[partition].add(offset)
        return False

    def dispose(self, partition: int, offset: int) -> None:
        self.pending[partition].discard(offset)
        self.done[partition].add(offset)

    def floor(self, partition: int) -> int:
        pend = self.pending.get(partition)
        return min(pend) if pend else self.read_pos[partition]

    def snapshot(self) -> dict[str, dict]:
        """``{partition: {"floor": f, "done": [offsets >= f]}}``; prunes disposed offsets below floors."""
        out = {}
        for p in sorted(self.read_pos):
            f = self.floor(p)
            self.done[p] = {o for o in self.done[p] if o >= f}
            out[str(p)] = {"floor": f, "done": sorted(self.done[p])}
        return out

    def pending_count(self) -> int:
        return sum(len(s) for s in self.pending.values())


@dataclass
class PromptGroup:
    """The samples of one GRPO prompt group (one prompt, ``size`` samples) seen so far."""

    id: str
    """The prompt group's id (the records' ``group_id``)."""
    size: int
    first_seen: float
    samples: list = field(default_factory=list)
    complete: bool = False
    closed_at: float | None = None
    close_order: int = -1

    @property
    def version_min(self) -> int:
        return min(s.version_min for s in self.samples)

    @property
    def group_seq(self) -> int:
        return self.samples[0].group_seq if self.samples else -1


class GroupAssembler:
    """Open groups by id, plus the queue of closed groups waiting for a step."""

    def __init__(self, timeout_s: float, memory: int = 20_000, trained_ids: list[str] | None = None):
        self.timeout_s = timeout_s
        self.memory = memory
        self.open: dict[str, PromptGroup] = {}
        self.ready: list[PromptGroup] = []
        self._closed = 0
        self._queued: set[str] = set()
        self.trained: OrderedDict[str, None] = OrderedDict((g, None) for g in (trained_ids or []))
        self.expected: dict[str, frozenset[str]] = {}

    def expect(self, members: dict[str, frozenset[str]]) -> None:
        """Fix the members of these groups (a replay schedule): each closes when it holds exactly
        them (complete if that is ``group_size`` samples), never by timeout; other samples of such
        a group are refused as late."""
        self.expected.update(members)

    def add(self, sample, now: float) -> str:
        """Add a sample: "added", "complete" (its group just closed), "late" or "duplicate"."""
        gid = sample.prompt_group
        if gid in self.trained or gid in self._queued:
            return "late"
        members = self.expected.get(gid)
        if members is not None and sample.trajectory_id not in members:
            return "late"  # the original run refused it, or it came after the group closed there
        g = self.open.get(gid)
        if g is None:
            g = self.open[gid] = PromptGroup(gid, sample.group_size, now)
        elif any(s.trajectory_id == sample.trajectory_id for s in g.samples):
            return "duplicate"
        g.samples.append(sample)
        if len(g.samples) >= (g.size if members is None else len(members)):
            g.complete = len(g.samples) >= g.size
            self._close(g, now)
            return "complete"
        return "added"

    def expire(self, now: float) -> list[PromptGroup]:
        """Close every open group older than the timeout (incomplete); not the expected ones."""
        old = [g for g in self.open.values() if now - g.first_seen >= self.timeout_s and g.id not in self.expected]
        for g in old:
            self._close(g, now)
        return old

    def _close(self, g: PromptGroup, now: float) -> None:
        del self.open[g.id]
        g.closed_at = now
        g.close_order = self._closed
        self._closed += 1
        g.samples.sort(key=lambda s: (s.partition, s.offset))
        self.ready.append(g)
        self._queued.add(g.id)

    def take(self, n: int) -> list[PromptGroup] | None:
        """The ``n`` oldest closed groups (group_seq, version_min, closing order), or None if fewer are ready."""
        if len(self.ready) < n:
            return None
        self.ready.sort(key=lambda g: (g.group_seq, g.version_min, g.close_order))
        out, self.ready = self.ready[:n], self.ready[n:]
        self._consumed(out)
        return out

    def take_ids(self, ids: list[str]) -> list[PromptGroup]:
        """Remove the closed groups ``ids`` (all must be ready) from the queue, in that order."""
        if not ids:
            return []
        want = set(ids)
        by_id = {g.id: g for g in self.ready if g.id in want}
        out = [by_id[i] for i in ids]
        self.ready = [g for g in self.ready if g.id not in want]
        self._consumed(out)
        return out

    def _consumed(self, groups: list[PromptGroup]) -> None:
        """Remember ``groups`` as taken (a late sample of one is refused)."""
        for g in groups:
            self._queued.discard(g.id)
            self.trained[g.id] = None
            self.expected.pop(g.id, None)
        while len(self.trained) > self.memory:
            self.trained.popitem(last=False)

    def filter_ready(self, keep) -> list[PromptGroup]:
        """Remove and return the closed groups for which ``keep(group)`` is False (dynamic sampling)."""
        kept: list[PromptGroup] = []
        out: list[PromptGroup] = []
        for g in self.ready:
            (kept if keep(g) else out).append(g)
        if out:
            self.ready = kept
            self._consumed(out)
        return out

    def trained_ids(self) -> list[str]:
        return list(self.trained)
