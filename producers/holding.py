"""Finished samples held back until the last sample of their prompt message finishes
(``rollout.restart_scope``), so that a weight load which makes a held sample certain to be
dropped as stale can generate it again instead.

The trainer trains a group only once it is complete, so holding a message's finished samples
until its slowest one ends delays nothing downstream. Bookkeeping only: no Kafka, no engine; the
rollout worker decides what is stale and publishes what ``finished`` hands back. Not the offset
ledger (``ledger.py``), which counts broker acknowledgements.
"""

from __future__ import annotations

from collections.abc import Callable

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

    def take(self, pred: Callable[[object], bool]) -> list:
        """Remove the held samples matching ``pred`` (the caller runs them again): their messages
        wait for them as for any unfinished sample."""
        out = []
        for k in list(self._done):
            keep, go = [], []
            for s in self._done[k]:
                (go if pred(s) else keep).append(s)
            if go:
                self._left[k] += len(go)
                out.extend(go)
                if keep:
                    self._done[k] = keep
                else:
                    del self._done[k]
        return out

    def held(self) -> int:
        return sum(len(v) for v in self._done.values())
