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

Groups with a quorum (``rollout.overprovision_tail = "train"``: ``TrainSample.quorum`` > 0) close,
complete, once their first ``quorum`` samples are in; the rest of the group is its *tail*. A tail
sample that arrives while its group waits in the queue joins it; one that arrives after a step took
the group waits in ``tails`` with the rewards of the samples that group was taken with (``Head``,
kept for ``memory`` groups and in the checkpoint), and the next step trains it with a baseline
computed over those rewards and its own (``batch.plan_step``). Tails do not count as groups.

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
class Head:
    """A quorum group a step has taken: what its tail samples are trained against."""

    rewards: dict[str, float]
    """Trajectory id -> reward of the samples the group was taken with, then of its tail samples
    in the order they came (a repeated id is a duplicate)."""
    size: int
    """The group's ``group_size``: once ``rewards`` has that many, no more tail can come."""

    def state(self, pending: set[str]) -> dict:
        """For the checkpoint, without the tail samples still ``pending`` (read, not yet in a step):
        after a restart they are read again."""
        return {"rewards": {t: r for t, r in self.rewards.items() if t not in pending}, "size": self.size}

    @classmethod
    def of(cls, state: dict) -> Head:
        return cls({str(t): float(r) for t, r in state["rewards"].items()}, int(state["size"]))


@dataclass(frozen=True)
class Tail:
    """A tail sample waiting for a step, with the rewards of its group's earlier samples."""

    sample: object
    baseline_rewards: tuple[float, ...]


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
    quorum: int = 0
    """Samples that close it (its first sample's ``quorum``); 0 = ``size``."""

    @property
    def version_min(self) -> int:
        return min(s.version_min for s in self.samples)

    @property
    def group_seq(self) -> int:
        return self.samples[0].group_seq if self.samples else -1


class GroupAssembler:
    """Open groups by id, plus the queue of closed groups waiting for a step."""

    def __init__(
        self, timeout_s: float, memory: int = 20_000, trained_ids: list[str] | None = None, heads: dict | None = None
    ):
        self.timeout_s = timeout_s
        self.memory = memory
        self.open: dict[str, PromptGroup] = {}
        self.ready: list[PromptGroup] = []
        self._closed = 0
        self._queued: set[str] = set()
        self.trained: OrderedDict[str, None] = OrderedDict((g, None) for g in (trained_ids or []))
        self.expected: dict[str, frozenset[str]] = {}
        self.heads: OrderedDict[str, Head] = OrderedDict((g, Head.of(h)) for g, h in (heads or {}).items())
        """Quorum groups taken by a step whose tail may still come."""
        self.tails: list[Tail] = []
        """Tail samples of taken groups, waiting for a step (``take_tails``)."""
        self.expected_tails: set[str] | None = None
        """A replay schedule's tail samples (``expect``): only these are accepted as tails."""
        self._early: dict[str, list] = {}
        """Replay only: tail samples read while their group still waits in the queue."""

    def expect(self, members: dict[str, frozenset[str]], tails: set[str] | None = None) -> None:
        """Fix the members of these groups (a replay schedule): each closes when it holds exactly
        them (complete if that is ``group_size`` samples), never by timeout; other samples of such
        a group are refused as late. ``tails``: the schedule's tail samples, the only ones then
        accepted as tails."""
        self.expected.update(members)
        if tails is not None:
            self.expected_tails = (self.expected_tails or set()) | tails

    def add(self, sample, now: float) -> str:
        """Add a sample: "added", "complete" (its group just closed), "tail" (a tail sample of a group
        a step took, ``tails``), "late" or "duplicate"."""
        gid = sample.prompt_group
        if gid in self.trained or gid in self._queued:
            return self._add_tail(sample) if getattr(sample, "quorum", 0) else "late"
        members = self.expected.get(gid)
        if members is not None and sample.trajectory_id not in members:
            return "late"  # the original run refused it, or it came after the group closed there
        g = self.open.get(gid)
        if g is None:
            g = self.open[gid] = PromptGroup(gid, sample.group_size, now, quorum=getattr(sample, "quorum", 0))
        elif any(s.trajectory_id == sample.trajectory_id for s in g.samples):
            return "duplicate"
        g.samples.append(sample)
        if len(g.samples) >= ((g.quorum or g.size) if members is None else len(members)):
            g.complete = len(g.samples) >= (g.quorum or g.size)
            self._close(g, now)
            return "complete"
        return "added"

    def _add_tail(self, sample) -> str:
        """A sample of a closed quorum group: into the group while it waits in the queue (not under a
        replay schedule, which fixed its members), else a tail against its ``Head``."""
        gid, tid = sample.prompt_group, sample.trajectory_id
        if self.expected_tails is not None and tid not in self.expected_tails:
            return "late"  # the replayed run did not train it as a tail
        if gid in self._queued:
            if self.expected_tails is not None:  # a tail there: it waits until a step takes its group
                early = self._early.setdefault(gid, [])
                if any(s.trajectory_id == tid for s in early):
                    return "duplicate"
                early.append(sample)
                return "added"
            g = next(g for g in self.ready if g.id == gid)
            if any(s.trajectory_id == tid for s in g.samples):
                return "duplicate"
            g.samples.append(sample)
            return "added"
        head = self.heads.get(gid)
        if head is None:
            return "late"  # its group was not a quorum group, or is forgotten
        if tid in head.rewards:
            return "duplicate"
        self.tails.append(Tail(sample, tuple(head.rewards.values())))
        head.rewards[tid] = sample.reward
        return "tail"

    def take_tails(self, ids: frozenset[str] | None = None) -> list[Tail] | None:
        """The waiting tail samples (all, or exactly ``ids``: None while one of them is missing). A
        group whose every sample has now been taken is forgotten."""
        if ids is None:
            out, self.tails = self.tails, []
        else:
            if not ids <= {t.sample.trajectory_id for t in self.tails}:
                return None
            out = [t for t in self.tails if t.sample.trajectory_id in ids]
            self.tails = [t for t in self.tails if t.sample.trajectory_id not in ids]
        waiting = {t.sample.prompt_group for t in self.tails}
        for gid in {t.sample.prompt_group for t in out} - waiting:
            head = self.heads.get(gid)
            if head is not None and len(head.rewards) >= head.size:
                del self.heads[gid]
        return out

    def heads_state(self) -> dict[str, dict]:
        """The ``Head`` of every taken quorum group whose tail may still come (for the checkpoint),
        less the tail samples waiting for a step (they are read again after a restart)."""
        pending = {t.sample.trajectory_id for t in self.tails}
        return {g: h.state(pending) for g, h in self.heads.items()}

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
            if g.quorum and len(g.samples) < g.size:
                self.heads[g.id] = Head({s.trajectory_id: s.reward for s in g.samples}, g.size)
                for s in self._early.pop(g.id, []):
                    self._add_tail(s)
        while len(self.trained) > self.memory:
            self.trained.popitem(last=False)
        while len(self.heads) > self.memory:
            self.heads.popitem(last=False)

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
