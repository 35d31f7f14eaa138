"""Which closed groups a trainer step takes (``trainer.group_order``), and the replay schedule.

Three selectors over a ``GroupAssembler``; each ``select`` returns ``(filtered, groups)``: the
groups dynamic sampling set aside now (they go with the next step) and the step's groups, or None
while the step must wait.

* ``ArrivalSelector`` (``arrival``, the default): the live trainer's rule. Dynamic sampling filters
  every closed group as it closes; a step takes the G oldest closed groups (group_seq, version_min,
  closing order) as soon as G are closed. Which groups those are depends on the order in which the
  consumer fetched the partitions.
* ``SequenceSelector`` (``sequence``): deterministic on a finished log. A step is planned only once
  the trainer has read rl.scored to its end, and groups are taken in (group_seq, prompt group id) order:
  the walk from the oldest group filters (dynamic sampling) or takes closed groups and stops at the
  first group still open (it closes when complete or at ``group_timeout_s``, with the same content
  whatever the fetch order) or when it has G. So the steps are a function of the log alone.
* ``ScheduleSelector`` (``rlstream replay --from-run``): step ``n`` takes exactly the groups the
  original run's step ``n`` took (``schedule_from_steps_log``), each closed with exactly the samples
  that step disposed of (``GroupAssembler.expect``), at the same version; it waits until they are
  all closed, and raises ``ScheduleError`` once rl.scored has been read to its end without them.

Not the staleness gate (``batch.plan_step``) and no Kafka: the worker says whether it has reached
the end of the topic.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import RlstreamError

DISPOSED_KEYS = ("used", "update_skipped", "stale", "incomplete_dropped", "overlong", "filtered")
"""The steps-log keys that list the trajectory ids a step disposed of (each id in exactly one)."""


class ScheduleError(RlstreamError):
    """A replay schedule that this rl.scored log cannot follow (a scheduled group never closes, or
    the schedule does not match the log or the trainer's version)."""


@dataclass(frozen=True)
class ScheduledStep:
    step: int
    version: int
    groups: tuple[str, ...]
    """Groups the step trains (stale and incomplete-dropped samples included), in the original order."""
    filtered_groups: tuple[str, ...]
    """Groups dynamic sampling filtered with this step."""
    members: dict[str, frozenset[str]]
    """Group id -> the trajectory ids the original step disposed of: the group closes with exactly these."""
    tails: frozenset[str] = frozenset()
    """Tail samples (of quorum groups earlier steps took) the original step disposed of."""


def schedule_from_steps_log(steps: list[dict], group_of: dict[str, set[str]]) -> list[ScheduledStep]:
    """The schedule of a committed steps log (``state.read_steps_log``). ``group_of`` maps each
    trajectory id of the scored log to the group ids its records name. ``ScheduleError`` when the
    log does not start at step 1 and count up, or a step's group has no disposed sample in the log."""
    out = []
    for n, s in enumerate(steps, start=1):
        if s["step"] != n or s["version"] != n - 1:
            raise ScheduleError(
                f"steps log line {n} is step {s['step']} at version {s['version']}: a replay schedule needs "
                "the whole log from step 1 (version 0), one version per step"
            )
        gids = [*s.get("groups", ()), *s.get("filtered_groups", ())]
        members: dict[str, set[str]] = {g: set() for g in gids}
        tails = set()
        for key in DISPOSED_KEYS:
            for tid in s.get(key, ()):
                ours = [g for g in group_of.get(tid, ()) if g in members]
                for g in ours:
                    members[g].add(tid)
                if not ours:  # a tail sample: its group was taken by an earlier step
                    tails.add(tid)
        empty = [g for g, m in members.items() if not m]
        if empty:
            raise ScheduleError(
                f"step {n} names groups {empty[:5]} but none of their samples is in the scored log: "
                "the steps log and the log do not belong together"
            )
        out.append(
            ScheduledStep(
                n, n - 1, tuple(s.get("groups", ())), tuple(s.get("filtered_groups", ())),
                {g: frozenset(m) for g, m in members.items()}, frozenset(tails),
            )
        )  # fmt: skip
    return out


class ArrivalSelector:
    needs_end = False

    def __init__(self, groups_per_step: int):
        self.G = groups_per_step

    def select(self, asm, version: int, at_end: bool, step: int, keep=None):
        filtered = asm.filter_ready(keep) if keep is not None else []
        return filtered, asm.take(self.G)

    def take_tails(self, asm, step: int) -> list:
        """The tail samples the step trains beside its groups: every one waiting."""
        return asm.take_tails()


class SequenceSelector:
    needs_end = True

    def __init__(self, groups_per_step: int):
        self.G = groups_per_step

    def select(self, asm, version: int, at_end: bool, step: int, keep=None):
        if not at_end:
            return [], None
        filtered, chosen = [], []
        for g in sorted([*asm.ready, *asm.open.values()], key=lambda g: (g.group_seq, g.id)):
            if g.closed_at is None:
                break  # an older group is still assembling: wait for it
            if keep is not None and not keep(g):
                filtered.append(g)
                continue
            chosen.append(g)
            if len(chosen) == self.G:
                break
        asm.take_ids([g.id for g in filtered])
        if len(chosen) < self.G:
            return filtered, None
        return filtered, asm.take_ids([g.id for g in chosen])

    take_tails = ArrivalSelector.take_tails


class ScheduleSelector:
    needs_end = True

    def __init__(self, schedule: list[ScheduledStep]):
        self.schedule = schedule

    def expectations(self, from_step: int) -> dict[str, frozenset[str]]:
        """Members of every group the steps after ``from_step`` take (for ``GroupAssembler.expect``)."""
        return {g: m for st in self.schedule[from_step:] for g, m in st.members.items()}

    def tail_ids(self, from_step: int) -> set[str]:
        """The tail samples the steps after ``from_step`` train (for ``GroupAssembler.expect``)."""
        return {t for st in self.schedule[from_step:] for t in st.tails}

    def take_tails(self, asm, step: int) -> list:
        return asm.take_tails(self.schedule[step].tails)

    def select(self, asm, version: int, at_end: bool, step: int, keep=None):
        if step >= len(self.schedule):
            raise ScheduleError(f"the replay schedule has {len(self.schedule)} steps; step {step + 1} has none")
        st = self.schedule[step]
        if st.version != version:
            raise ScheduleError(f"scheduled step {st.step} was at version {st.version}, this trainer is at {version}")
        ready = {g.id for g in asm.ready}
        missing = [g for g in (*st.groups, *st.filtered_groups) if g not in ready]
        tails = st.tails - {t.sample.trajectory_id for t in asm.tails}
        if not missing and not tails:
            return asm.take_ids(list(st.filtered_groups)), asm.take_ids(list(st.groups))
        if at_end:
            why = describe(asm, st, missing) if missing else f"tail samples {sorted(tails)[:5]} never came"
            raise ScheduleError(f"step {st.step} cannot be replayed: {why}")
        return [], None


def describe(asm, st: ScheduledStep, missing: list[str]) -> str:
    """Why the groups ``missing`` of scheduled step ``st`` are not closed, for the error message."""
    parts = []
    for gid in missing[:5]:
        want = len(st.members[gid])
        if gid in asm.open:
            parts.append(f"group {gid} has {len(asm.open[gid].samples)} of the {want} samples the original step used")
        elif gid in asm.trained:
            parts.append(f"group {gid} was already taken by an earlier step")
        else:
            parts.append(f"group {gid} has none of its {want} samples")
    more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
    return "; ".join(parts) + more + " after reading rl.scored to its end"
