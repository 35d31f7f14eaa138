"""Stale restarts: which samples a weight load makes certain to be dropped (``StaleRestarts``),
and finished samples held back until the last sample of their prompt message finishes
(``rollout.restart_scope``), so that a weight load which makes a held sample certain to be
dropped as stale can generate it again instead. Over-provisioned groups
(``rollout.overprovision``, ``GroupRace``): the first ``group_size`` samples of a message to
finish are its group, the others are aborted.

The trainer trains a group only once it is complete, so holding a message's finished samples
until its slowest one ends delays nothing downstream. Bookkeeping only: no Kafka, no engine; the
rollout worker decides what is stale and publishes what ``finished`` hands back. Not the offset
ledger (``ledger.py``), which counts broker acknowledgements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.control import is_stale

Key = tuple[tuple[str, int], int, int]
"""(partition, offset, ledger generation): one admitted prompt message."""


class SampleHold:
    def __init__(self) -> None:
        self._left: dict[Key, int] = {}
        """Samples of the message not finished yet (running, queued, or in an environment step)."""
        self._done: dict[Key, list] = {}

    @staticmethod
    def key(s) -> Key:
        return (s.tp, s.offset, s.gen)

    def admit(self, key: Key, samples: int) -> None:
        self._left[key] = self._left.get(key, 0) + samples

    def finished(self, s) -> list:
        """``s`` has finished: the samples to publish now, ``[]`` while others of its message are
        not done. A sample of a message never admitted here is handed back at once."""
        k = self.key(s)
        left = self._left.get(k)
        if left is None:
            return [s]
        if left > 1:
            self._left[k] = left - 1
            self._done.setdefault(k, []).append(s)
            return []
        del self._left[k]
        return [*self._done.pop(k, []), s]

    def reopen(self, s, done: list, again: list) -> None:
        """The message of ``s`` (``done``, all of it just handed back by ``finished``) waits again:
        the samples of ``again`` run again, the rest stay held."""
        k, redo = self.key(s), {id(x) for x in again}
        self._left[k] = len(again)
        self._done[k] = [x for x in done if id(x) not in redo]

    def take(self, pred: Callable[[object], bool]) -> list:
        """Remove the held samples matching ``pred`` (the caller runs them again): their messages
        wait for them as for any unfinished sample."""
        out = []
        for k in list(self._done):
            keep, go = [], []
            for s in self._done[k]:
                (go if pred(s) else keep).append(s)
            if go:
                self._left[k] = self._left.get(k, 0) + len(go)
                out.extend(go)
                if keep:
                    self._done[k] = keep
                else:
                    del self._done[k]
        return out

    def held(self) -> int:
        return sum(len(v) for v in self._done.values())


class GroupRace:
    """``rollout.overprovision``: a message drawn with extra samples publishes the first ``keep``
    to finish, numbered by the order they finished (``Sample.rank``), once all ``keep`` have; the
    worker aborts the rest, or (``tail``, ``rollout.overprovision_tail = "train"``) lets them run
    and passes each on as it finishes, numbered on from ``keep``. A sample already ranked (a winner
    regenerated after a stale restart) passes straight through."""

    def __init__(self, tail: bool = False) -> None:
        self.tail = tail
        self._drawn: dict[Key, list] = {}
        self._won: dict[Key, list] = {}
        self._keep: dict[Key, int] = {}
        self._next: dict[Key, int] = {}
        """``tail``: the rank the group's next tail sample gets, once its first ``keep`` are in."""

    def admit(self, key: Key, samples: list, keep: int) -> None:
        self._drawn[key], self._won[key], self._keep[key] = list(samples), [], keep

    def finished(self, s) -> tuple[list, list]:
        """``s`` has finished: (the samples to pass on now, the samples to abort). A sample of a
        message not racing, or one already ranked, passes on at once."""
        k = SampleHold.key(s)
        if s.rank is not None:
            return [s], []
        if k in self._next:  # a tail sample
            s.rank = self._next[k]
            self._next[k] += 1
            if self._next[k] == len(self._drawn[k]):
                del self._next[k], self._drawn[k]
            return [s], []
        if k not in self._drawn:
            return [s], []
        won = self._won[k]
        won.append(s)
        if len(won) < self._keep[k]:
            return [], []
        for rank, x in enumerate(won):
            x.rank = rank
        del self._won[k], self._keep[k]
        if self.tail:
            if len(won) < len(self._drawn[k]):
                self._next[k] = len(won)
            else:
                del self._drawn[k]
            return won, []
        winners = {id(x) for x in won}
        losers = [x for x in self._drawn.pop(k) if id(x) not in winners]
        return won, losers

    def racing(self) -> int:
        """Finished samples waiting for the rest of their group's winners."""
        return sum(len(v) for v in self._won.values())


@dataclass(frozen=True)
class StaleRestarts:
    """The restart policy (``rollout.stale_restarts``, ``rollout.restart_scope``): which samples go
    back to the queue because the trainer, at the version just loaded or later, is certain to drop
    them as stale. Single-turn samples only, each at most ``limit`` times."""

    limit: int
    k: int
    token_rule: bool
    in_flight: bool
    """Restart samples interrupted by a load (``interrupt`` policy, sample rule: the token rule
    trains a late sample's fresh tokens)."""
    finished: bool
    """Hold finished samples and regenerate those a load dooms."""
    margin: int = 0
    """Versions beyond the loaded one at which a complete message's held samples are checked."""
    load_margin: int = 0
    """The same look-ahead for the held samples of a message still generating, at each weight load:
    ``margin`` under the token rule with ``interrupt`` reloads (the sample the message waits for
    then carries tokens of every newer version, so the group trains late but trains), else 0."""

    @classmethod
    def of(cls, rc, staleness_rule: str, k: int) -> StaleRestarts:
        scope, token_rule = rc.restart_scope, staleness_rule == "token"
        in_flight = rc.reload_policy == "interrupt" and scope in ("all", "in_flight") and not token_rule
        finished = bool(rc.stale_restarts) and scope in ("all", "finished")
        margin = rc.restart_margin if rc.restart_margin is not None else int(k >= 2)
        load_margin = margin if token_rule and rc.reload_policy == "interrupt" else 0
        return cls(rc.stale_restarts, k, token_rule, in_flight, finished, margin, load_margin)

    def stale(self, s, version: int, finished: bool = False) -> bool:
        """``s`` would be dropped at trainer ``version``. In flight: by ``version_min``. Finished:
        by its newest token under the token rule, else by ``version_min``."""
        oldest_kept = s.version_max if finished and self.token_rule else s.version_min
        return oldest_kept is not None and is_stale(version, oldest_kept, self.k)

    def likely_lost(self, last, done: list, loaded: int) -> list:
        """``last`` has just completed its message (``done``): the other samples the trainer would
        drop at its likely version when the group lands (``loaded`` + ``margin``), if ``last``
        itself would train; else none."""
        soon = loaded + self.margin
        if not self.margin or self.stale(last, soon, finished=True):
            return []
        return [x for x in done if x is not last and self.doomed(x, soon, finished=True)]

    def held_doomed(self, s, loaded: int) -> bool:
        """Held sample ``s`` is to be generated again at the weight load of version ``loaded``: the
        trainer would drop it at ``loaded`` + ``load_margin``. Its message still waits for another
        sample, and the trainer trains the group no earlier than the version that one finishes
        under, so with a margin the held sample runs again now, beside that sample, rather than
        after it (``likely_lost``) while the whole group waits."""
        return self.doomed(s, loaded + self.load_margin, finished=True)

    def doomed(self, s, version: int, finished: bool = False) -> bool:
        """``s`` is stale at ``version`` and may be generated again."""
        enabled = self.finished if finished else self.in_flight
        return enabled and s.env is None and s.restarts < self.limit and self.stale(s, version, finished)
