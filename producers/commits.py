"""The rollout worker's prompt-offset commits and rebalance bookkeeping, beside its ledger.

``PromptCommits`` owns the ``OffsetLedger`` (``producers.ledger``: which offsets are fully
acknowledged) and everything the worker does with it on the Kafka side:

* entering a consumed message (``track``) and counting its acknowledgements down (``acker``, a
  delivery callback); a partition re-delivered from an earlier offset starts a new ledger
  generation (``restart_if_rewound``): what was in flight for it still gets published, nothing of
  it is committed;
* committing what the ledger allows (``commit``): in the loop asynchronously, at most every
  ``interval_s``, with the results in ``on_commit`` (the consumer's ``on_commit`` callback);
  forced (revoke, finish) synchronously, under a watchdog section, so the offsets are in before
  partitions go. A failed forced commit is counted (``commit_errors``) and logged: the partition's
  next owner generates those prompts again (at-least-once, deduplicated by trajectory id);
* the rebalance callbacks (``subscribe``): on a revoke the worker finishes the admitted messages of
  the revoked partitions (its ``finish`` callback), then they are committed and forgotten; after a
  failure, or a stop that could not finish (``hand_over``), nothing is finished (the next owner
  takes them); a lost partition is forgotten at once.

What this is not: the worker's generation loop (``producers.rollout``), nor the pure arithmetic of
acknowledgements (``producers.ledger``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from pipeline.errors import ConsumeError
from pipeline.kafka import Consumer, TopicPartition
from pipeline.log import kv
from producers.ledger import TP, OffsetLedger

log = logging.getLogger(__name__)


def _unwatched(what: str, seconds: float):
    return contextlib.nullcontext()


class PromptCommits:
    """Prompt offsets of one rollout worker: tracked, committed in offset order once acknowledged,
    and handed over cleanly on a rebalance (module docstring)."""

    def __init__(self, metrics, commit_timeout_s: float, section: Callable = _unwatched, interval_s: float = 0.2):
        self.metrics = metrics
        self.ledger = OffsetLedger()
        self.to_commit: dict[TP, int] = {}
        """Offsets the ledger released that are not known to be committed yet."""
        self.consumer: Consumer | None = None
        self.commit_timeout_s, self.interval_s = commit_timeout_s, interval_s
        self._section = section
        self._last_commit = 0.0
        self._failures = 0
        self._handed_over = False

    # -- the ledger ------------------------------------------------------------------------------
    def restart_if_rewound(self, tp: TP, offset: int) -> bool:
        """If ``tp`` is re-delivered from an earlier offset, forget its old state (a new ledger
        generation): samples already admitted still publish, their offsets are not committed. True
        if so (the caller forgets what it queued of ``tp``)."""
        if not self.ledger.rewound(tp, offset):
            return False
        log.warning("partition rewound; restarting its bookkeeping %s", kv(partition=tp[1], offset=offset))
        self.metrics.inc("partition_rewinds")
        self.forget([tp])
        return True

    def track(self, tp: TP, offset: int, acks: int) -> int:
        """Enter message ``offset`` of ``tp``, done after ``acks`` acknowledgements; returns the
        ledger generation to pass to ``acker``."""
        return self.ledger.add(tp, offset, acks)

    def acker(self, tp: TP, offset: int, gen: int):
        """A delivery callback counting one acknowledgement of message ``offset``."""

        def cb(err, _msg):
            if err is None:  # on error the Producer raises on the next produce/flush: no commit
                self.ledger.ack(tp, offset, gen)

        return cb

    def outstanding(self) -> int:
        """Messages not yet fully acknowledged."""
        return self.ledger.outstanding()

    def forget(self, tps) -> None:
        """Drop the state of partitions (revoked, lost, rewound)."""
        tps = list(tps)
        self.ledger.drop(tps)
        for tp in tps:
            self.to_commit.pop(tp, None)

    # -- commits ---------------------------------------------------------------------------------
    def commit(self, force: bool = False, tps: set[TP] | None = None) -> None:
        """Commit what the ledger allows. In the loop (``force`` False) asynchronously, at most every
        ``interval_s``: a synchronous commit can block for a whole session timeout during a
        rebalance or a broker outage, and the loop must keep going; results arrive in
        ``on_commit``. ``force`` (revoke, finish) commits synchronously, so the offsets are in before
        partitions go."""
        if not force and time.monotonic() - self._last_commit < self.interval_s:
            return
        self._last_commit = time.monotonic()
        for o in self.ledger.committable(tps):
            self.to_commit[(o.topic, o.partition)] = o.offset
        todo = {tp: off for tp, off in self.to_commit.items() if tps is None or tp in tps}
        if not todo:
            return
        offsets = [TopicPartition(t, p, off) for (t, p), off in todo.items()]
        if not force:
            self.consumer.commit(offsets, asynchronous=True)
            return
        try:
            with self._section("commit", self.commit_timeout_s):
                self.consumer.commit(offsets)
        except ConsumeError as exc:  # e.g. REBALANCE_IN_PROGRESS: the partition's next owner re-generates
            self.metrics.inc("commit_errors")
            log.warning("final commit failed %s", kv(error=exc, offsets=sorted((tp[1], o) for tp, o in todo.items())))
            return
        self._committed(todo)

    def on_commit(self, err, partitions) -> None:
        """Result of an asynchronous commit (served inside consume): forget what is in; keep the rest."""
        if err is not None:
            self._failures += 1
            self.metrics.inc("commit_errors")
            if self._failures % 25 == 1:
                log.warning("commit failed, will retry %s", kv(error=err, failures=self._failures))
            return
        self._failures = 0
        self._committed({(tp.topic, tp.partition): tp.offset for tp in partitions if tp.error is None})

    def _committed(self, done: dict) -> None:
        for tp, off in done.items():
            if self.to_commit.get(tp, off + 1) <= off:
                del self.to_commit[tp]

    def hand_over(self) -> None:
        """A stop that could not finish (its trajectories unacknowledged, or its samples unfinished
        in the stop budget) leaves every uncommitted prompt to the next owner: the final revoke
        then finishes and commits nothing more."""
        self._handed_over = True

    # -- rebalances ------------------------------------------------------------------------------
    def subscribe(
        self,
        consumer: Consumer,
        topic: str,
        finish: Callable[[Callable[[TP], bool]], None],
        drop_queued: Callable[[Callable[[TP], bool]], None],
        failed: Callable[[], bool],
        on_assign: Callable | None = None,
    ) -> None:
        """Subscribe ``consumer`` (whose config has ``on_commit`` set to ``self.on_commit``) to
        ``topic`` with the rebalance bookkeeping. ``finish(pred)`` publishes every admitted sample of
        the partitions matching ``pred`` and waits for their acknowledgements; ``drop_queued(pred)``
        forgets the queued (unadmitted) messages of a lost partition; ``failed()`` says whether the
        worker is ending after an error (then a revoke finishes nothing); ``on_assign`` is called
        as confluent-kafka calls it, after each assignment."""
        self.consumer = consumer
        self._finish, self._drop_queued, self._failed = finish, drop_queued, failed
        consumer.subscribe([topic], on_assign=on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)

    def _on_revoke(self, _consumer, partitions) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        if self._failed() or self._handed_over:  # a failed worker's engine may never finish a sample
            why = "a failure" if self._failed() else "a stop that could not finish"
            log.warning("partitions revoked after %s; their uncommitted prompts go to the next owner %s",
                        why, kv(partitions=sorted(t[1] for t in tps)))  # fmt: skip
        else:
            log.info(
                "partitions revoked, finishing their admitted prompts %s", kv(partitions=sorted(t[1] for t in tps))
            )
            self._finish(lambda tp: tp in tps)
            self.commit(force=True, tps={tp for tp in self.ledger.parts if tp in tps})
        self.forget(tps)

    def _on_lost(self, _consumer, partitions) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        log.warning("partitions lost %s", kv(partitions=sorted(t[1] for t in tps)))
        self.forget(tps)
        self._drop_queued(lambda tp: tp in tps)
