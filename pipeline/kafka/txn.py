"""The exactly-once read-process-write loop of a stage (consume -> process -> produce -> offsets in
the transaction -> commit), as one object of the Kafka wrapper.

A stage (the reward worker today) keeps its own consumer and its own processing; per batch it
hands ``ExactlyOnceLoop.write`` the messages it read and a function that produces the batch's
output (``produce_record`` / ``produce``, into the open transaction). The loop owns the rest:

* the transactional producer: ``start`` runs ``init_transactions``, which fences an earlier
  producer with the same transactional id (a zombie) and aborts its open transaction;
* begin, produce, send the batch's next offsets with the consumer's group metadata, commit (a
  retriable commit error is retried, up to 10 attempts);
* a failed transaction: an error that says the transaction did not commit (abortable, or
  retriable but not a timeout) aborts it (an abort that fails during a broker outage is retried for
  up to ``outage_s``), and the batch is marked to be read again: ``rewound`` seeks its partitions
  back to the batch's first offsets, together with any batch read after it;
* an end of transaction whose outcome is unknown (a send-offsets, commit or abort call that timed
  out, or one librdkafka never returns from: ``WedgedClient``, librdkafka #5456) is never retried
  in the same producer epoch. librdkafka does not implement KIP-890 (#5423), so a request of that
  epoch still in flight could land after the transaction ended and open a "hanging" one (KAFKA-17754).
  The producer is retired and replaced in-process instead: the new one's ``init_transactions`` bumps the epoch,
  which fences every request of the old one, and completes or aborts the old transaction on the
  coordinator; ``rewound`` then seeks to the group's committed offsets (read_committed, so they
  say which way it went): nothing lost, nothing written twice, as KIP-890's client side proposes.
  A fatal error that is not a fencing (``recoverable_fatal``: e.g. an abort answered INVALID_TXN_STATE
  after the transaction coordinator moved) is handled the same way, within a budget
  (``MAX_REPLACEMENTS`` in ``REPLACE_WINDOW_S``). A fencing is raised: another instance owns the id,
  the stage exits;
* bounded budgets: every transaction call is bounded by the wrapper (``Producer.TXN_GRACE_S``) and,
  behind it, by the watchdog sections the stage passes in (``section``: ``transaction``,
  ``send_offsets_to_transaction``, ``commit_transaction``, ``abort_transaction``,
  ``replace producer``);
* ``overlap``: batch N's offsets and commit run on a commit thread while the stage reads and
  processes batch N+1; ``settle`` waits for it. The transaction is never open across a consumer
  poll on the main thread, and transaction N+1 begins only once N has ended. A rebalance callback
  calls ``hand_over`` first, so a partition never leaves with its transaction pending.

What this is not: a stage. It knows no topic, schema or metric of any role: the stage gives it a
consumer, a producer config, a transactional id, and hooks (``committed``, ``aborted``,
``replaced``) for its metrics.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import ConsumeError, KafkaClientError
from pipeline.kafka.common import fenced_member, next_offsets, recoverable_fatal, uncertain
from pipeline.kafka.consumer import Consumer
from pipeline.kafka.producer import Producer
from pipeline.log import kv

log = logging.getLogger(__name__)

MAX_REPLACEMENTS, REPLACE_WINDOW_S = 5, 600.0
"""More producer replacements than this within the window: raise (a restart is due)."""
COMMIT_ATTEMPTS = 10
INIT_SLICE_S = 10.0
"""A replacement's init_transactions runs in calls this long (each resumes the last), so that a
stop that comes while the coordinator is away is seen within this time."""
STOP_MARGIN_S = 8.0
"""Of the stop bound, what a replacement while stopping leaves for closing the clients."""
"""Attempts of ``commit_transaction`` on a retriable error before the transaction is aborted."""


class _StopDuringReplace(Exception):
    """A stop came while a replacement waited for the coordinator (``left``: seconds of its bound)."""

    def __init__(self, left: float):
        super().__init__(f"stop during a producer replacement ({left:.0f} s left)")
        self.left = left


def _unwatched(what: str, seconds: float):
    """No watchdog section (the default, and the commit thread's stand-in for ``section``)."""
    return contextlib.nullcontext()


def _direct(fn: Callable, what: str):
    return fn()


def _nothing(*_args) -> None:
    return None


@dataclass
class _Txn:
    """A transaction whose batch is produced; its offsets and commit run on the commit thread."""

    batch: list
    t0: float
    result: Any = None
    """What the stage's ``produce`` returned: handed to the ``committed`` hook."""
    checkpointed: threading.Event = field(default_factory=threading.Event)
    """Set once the commit path is past the fault-injection pause (``chaos_delay_s``)."""
    future: Future | None = None


class ExactlyOnceLoop:
    """Exactly-once read-process-write for one consumer and one transactional id (module docstring).

    ``section(what, seconds)`` declares a watchdog section (``Worker.section``); ``retry(fn, what)``
    runs a start-up call with transient retries (``Worker.startup_call``). Hooks, all optional:
    ``committed(result, txn_ms)`` after a commit, ``aborted(exc)`` after an abort, ``replaced(exc)``
    before a wedged producer is replaced. ``chaos_delay_s`` (fault injection, tests only) flushes
    and sleeps inside every transaction, after producing and before the offsets.
    """

    def __init__(
        self,
        consumer: Consumer,
        producer_conf: dict,
        transactional_id: str,
        *,
        request_timeout_s: float,
        watchdog_s: float,
        outage_s: float,
        overlap: bool = False,
        section: Callable = _unwatched,
        retry: Callable = _direct,
        committed: Callable[[Any, float], None] = _nothing,
        aborted: Callable[[Exception], None] = _nothing,
        replaced: Callable[[Exception], None] = _nothing,
        stop_left: Callable[[], float | None] = lambda: None,
        chaos_delay_s: float = 0.0,
        worker_id: str = "",
    ):
        self.consumer = consumer
        self.transactional_id = transactional_id
        self.worker_id = worker_id or transactional_id
        self._pconf = producer_conf
        self._section, self._retry = section, retry
        self._hooks = {"committed": committed, "aborted": aborted, "replaced": replaced}
        self._stop_left = stop_left
        """Seconds left of the caller's stop bound (None: not stopping): a replacement then gets a
        bounded try instead of the patient one."""
        self.request_timeout_s, self.watchdog_s, self.outage_s = request_timeout_s, watchdog_s, outage_s
        self.chaos_delay_s = chaos_delay_s
        # The watchdog's limit of one transaction call: the last resort behind the wrapper's own bound
        # (Producer.TXN_GRACE_S: librdkafka #5456 can block send_offsets_to_transaction forever).
        self.call_s = request_timeout_s + 30
        self.commit_wait_s = self.call_s * (COMMIT_ATTEMPTS + 1)  # send_offsets, then the commit attempts
        # The checkpoint inside a transaction: with the chaos delay it first flushes, bounded by the
        # request timeout (which a broker outage can use up), so the watchdog allows for that; the
        # sleep after it stands for a worker stuck in a transaction and gets the loop's own limit.
        self.flush_s = request_timeout_s + watchdog_s
        self.checkpoint_s = watchdog_s + (request_timeout_s if chaos_delay_s else 0.0)
        txn_timeout_s = int(producer_conf.get("transaction.timeout.ms", 60_000)) / 1000
        self.init_s = max(60.0, txn_timeout_s + 30)
        self.producer: Producer | None = None
        self._replaced_at: list[float] = []
        self.in_txn = False
        """A transaction is open (begun, not yet committed or aborted)."""
        self._txn: _Txn | None = None
        """The produced transaction whose commit is in flight (at most one)."""
        self._rewind_due: tuple[list, Exception, str, bool] | None = None
        """A failed transaction's batch, to be read again (with whatever was read after it), and
        whether its outcome is unknown (then from the group's committed offsets)."""
        self.overlap = overlap
        """Batch N's offsets and commit run on a commit thread while the stage reads batch N+1."""
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="txn-commit") if overlap else None

    # -- the producer ----------------------------------------------------------------------------
    def start(self) -> None:
        """The transactional producer; ``init_transactions`` fences (and aborts the open transaction
        of) any earlier producer with the same transactional id: a zombie, or a wedged one."""
        producer = self.producer = Producer(self._pconf, transactional_id=self.transactional_id)
        self._retry(lambda: producer.init_transactions(self.init_s), "init_transactions")

    def _replace_producer(self, exc: Exception) -> None:
        """A transaction call timed out or librdkafka blocked in it for good (after a broker restart),
        or the producer failed fatally without being fenced (``recoverable_fatal``): retire that client and start a new producer with the same transactional id, in this process (no
        restart, no rebalance). Its init_transactions bumps the epoch, fencing whatever the old one
        still has in flight, and completes or aborts the old transaction. The caller rewinds."""
        now = time.monotonic()
        self._replaced_at = [t for t in self._replaced_at if now - t < REPLACE_WINDOW_S] + [now]
        if len(self._replaced_at) > MAX_REPLACEMENTS:
            raise RuntimeError(
                f"replaced the transactional producer {len(self._replaced_at)} times in {REPLACE_WINDOW_S:.0f} s "
                f"(last: {exc}): exiting so that a restart starts clean"
            ) from exc
        log.warning(
            "transaction outcome unknown or producer unusable; replacing the producer %s",
            kv(worker_id=self.worker_id, error=exc),
        )
        self._hooks["replaced"](exc)
        self.in_txn = False
        old, self.producer = self.producer, None
        if old is not None:
            old.retire()  # never touched again: its requests are fenced by the new epoch
        left = self._stop_left()
        if left is not None:
            return self._fence_while_stopping(left - STOP_MARGIN_S)
        producer = self.producer = Producer(self._pconf, transactional_id=self.transactional_id)

        def attempt():  # in slices (a timed-out init_transactions resumes), so a stop meanwhile is seen
            if (left := self._stop_left()) is not None:
                raise _StopDuringReplace(left)
            producer.init_transactions(min(self.init_s, INIT_SLICE_S))

        try:
            with self._section("replace producer", self.outage_s + 60):
                self._retry(attempt, "init_transactions")
        except _StopDuringReplace as stop:
            self.producer = None
            self._fence_while_stopping(stop.left - STOP_MARGIN_S, producer)

    def _fence_while_stopping(self, budget: float, producer: Producer | None = None) -> None:
        """Stopping: one try, within what is left of the stop bound, to fence the old producer (which
        aborts its transaction at once). If the coordinator cannot answer in time, the process still
        stops in its bound: the open transaction is aborted by the broker at its
        ``transaction.timeout.ms`` (read_committed readers of its partitions wait until then) or by
        the next producer with this transactional id. Nothing is lost: its offsets were not committed."""
        if budget >= 1.0:
            producer = producer or Producer(self._pconf, transactional_id=self.transactional_id)
            try:
                with self._section("fence on stop", budget + 15):
                    producer.init_transactions(budget)
            except KafkaClientError as exc:  # timed out, or the call wedged (then bounded and left)
                producer.retire()
                log.warning(
                    "stopping: could not fence the old transaction in time; the broker aborts it at its timeout %s",
                    kv(worker_id=self.worker_id, error=exc),
                )
                return
            self.producer = producer
            return
        if producer is not None:
            producer.retire()
        log.warning("stopping: no time left to fence the old transaction; the broker aborts it at its timeout %s",
                    kv(worker_id=self.worker_id))  # fmt: skip

    # -- one batch -------------------------------------------------------------------------------
    def write(self, batch: list, produce: Callable[[], Any]) -> bool:
        """Write ``batch``'s output exactly once: end the transaction in flight, begin one, call
        ``produce()`` (which produces into it with ``produce_record``/``produce``; what it returns
        reaches the ``committed`` hook), then add the batch's offsets and commit: on the commit
        thread with ``overlap`` (it ends in the next ``settle``), else here. False, producing
        nothing, if the transaction before failed: ``batch`` was then rewound with it."""
        self.settle()  # transaction N ends (its commit overlapped the caller's work) before N+1 begins
        if self.rewound(batch):
            return False
        self._begin(batch, produce)
        if self._committer is None:
            self.settle()
            self.rewound([])
        return True

    def produce_record(self, topic: str, schema: str, record: dict, key=None, **kw) -> None:
        """Encode and produce ``record`` into the open transaction."""
        self._check_open()
        self.producer.produce_record(topic, schema, record, key=key, **kw)

    def produce(self, topic: str, value: bytes | None, key=None, **kw) -> None:
        """Produce raw bytes into the open transaction."""
        self._check_open()
        self.producer.produce(topic, value, key=key, **kw)

    def _check_open(self) -> None:
        if not self.in_txn:
            raise RuntimeError("produce outside a transaction: produce only from the function given to write()")

    def _begin(self, batch: list, produce: Callable[[], Any]) -> None:
        self.producer.begin_transaction()
        txn = self._txn = _Txn(batch, time.perf_counter())
        self.in_txn = True
        try:
            txn.result = produce()
        except Exception as exc:  # e.g. an earlier delivery error, raised on produce: settle aborts
            txn.future = Future()
            txn.future.set_exception(exc)
        else:
            if self._committer is not None:
                txn.future = self._committer.submit(self._end_txn, txn, _unwatched)
            else:
                txn.future = _run_now(self._end_txn, txn, self._section)
        txn.future.add_done_callback(lambda _: txn.checkpointed.set())  # also if it failed before it

    def _end_txn(self, txn: _Txn, watch) -> None:
        """Add the batch's offsets and commit. Every call is bounded by the wrapper (WedgedClient);
        inline, ``watch`` declares watchdog sections; on the commit thread it is a no-op (sections
        belong to the main thread, whose wait in ``settle`` is watched)."""
        try:
            self._txn_checkpoint(txn.batch, watch)
        finally:
            txn.checkpointed.set()
        with watch("send_offsets_to_transaction", self.call_s):
            self.producer.send_offsets_to_transaction(  # milliseconds normally; bounded short (+ grace)
                next_offsets(txn.batch), self.consumer, min(10.0, self.request_timeout_s)
            )
        self._commit(watch)

    def _txn_checkpoint(self, batch: list, watch) -> None:
        log.debug("transaction open %s", kv(worker_id=self.worker_id, batch=len(batch)))
        if self.chaos_delay_s:
            with watch("transaction flush", self.flush_s):
                self.producer.flush(self.request_timeout_s)  # the records really are on the broker
        with watch("transaction", self.watchdog_s):
            if self.chaos_delay_s:
                time.sleep(self.chaos_delay_s)

    def _commit(self, watch) -> None:
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                with watch("commit_transaction", self.call_s):
                    self.producer.commit_transaction(self.request_timeout_s)
                return
            except KafkaClientError as exc:
                ke = exc.kafka_error
                last = attempt == COMMIT_ATTEMPTS - 1
                if ke is None or not ke.retriable() or ke.fatal() or ke.txn_requires_abort() or last or uncertain(exc):
                    raise  # a timed-out commit is not retried in this epoch: settle replaces the producer
                log.warning("retrying commit %s", kv(error=exc, attempt=attempt + 1))

    @property
    def committing(self) -> bool:
        """A transaction's commit runs on the commit thread (``overlap``) and has not been settled."""
        return self._txn is not None

    # -- ending a transaction --------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for the transaction in flight to end. Committed: the ``committed`` hook. Failed:
        aborted (or the stuck producer replaced) and its batch marked to be read again
        (``rewound``). Fatal (fenced), or not a Kafka error: raised."""
        txn, self._txn = self._txn, None
        if txn is None:
            return
        with self._section("transaction", self.checkpoint_s):
            txn.checkpointed.wait(self.chaos_delay_s + self.checkpoint_s + self.commit_wait_s)
        with self._section("commit_transaction", self.commit_wait_s):
            try:
                exc = txn.future.exception(self.commit_wait_s)
            except TimeoutError:
                raise RuntimeError(
                    f"the commit thread did not end a transaction within {self.commit_wait_s:.0f} s"
                ) from None
        if exc is None:
            self.in_txn = False
            self._hooks["committed"](txn.result, (time.perf_counter() - txn.t0) * 1000)
            log.debug("transaction committed %s", kv(worker_id=self.worker_id, batch=len(txn.batch)))
            return
        unknown = uncertain(exc) or recoverable_fatal(exc)
        if unknown:
            self._replace_producer(exc)
            why = "producer replaced"
        elif isinstance(exc, KafkaClientError) and not exc.fatal:
            unknown = self._abort(exc)
            why = "producer replaced" if unknown else "transaction aborted"
        else:
            raise exc  # fenced or otherwise unusable: exit; a restart (same id) recovers cleanly
        self._rewind_due = (txn.batch, exc, why, unknown)

    def _abort(self, exc: Exception) -> bool:
        """Abort the failed transaction. An abort that times out (or wedges) has an unknown outcome
        too, and a fatal one that is not a fencing leaves an unusable producer: either way the
        producer is replaced instead, and True returned (rewind from committed offsets)."""
        deadline = time.monotonic() + self.outage_s
        while True:  # a broker outage can make the abort itself fail for a while: ride it out
            try:
                with self._section("abort_transaction", self.call_s):
                    self.producer.abort_transaction(self.request_timeout_s)
                break
            except KafkaClientError as abort_exc:
                if uncertain(abort_exc) or recoverable_fatal(abort_exc):
                    self._replace_producer(abort_exc)
                    return True
                if abort_exc.fatal or not abort_exc.retriable or time.monotonic() > deadline:
                    raise
                log.warning("abort failed, retrying %s", kv(error=abort_exc))
                time.sleep(1.0)
        self.in_txn = False
        self._hooks["aborted"](exc)
        return False

    def rewound(self, batch: list = ()) -> bool:
        """If a transaction failed: read its batch and ``batch`` (read after it) again, seeking every
        still-assigned partition back to its first offset (nothing skipped). True if so: the caller
        drops ``batch``."""
        if self._rewind_due is None:
            return False
        failed, exc, why, unknown = self._rewind_due
        self._rewind_due = None
        if self._stop_left() is not None:  # leaving: whoever owns the partitions next reads from the
            log.warning("%s; stopping, so not rewound (the next owner reads from the committed offsets) %s",
                        why, kv(worker_id=self.worker_id, error=exc))  # fmt: skip
            return True  # group's committed offsets (a seek would need the coordinator, maybe away)
        first: dict[tuple[str, int], int] = {}
        for m in [*failed, *batch]:
            key = (m.topic(), m.partition())
            first[key] = min(first.get(key, m.offset()), m.offset())
        assigned = self.consumer.assignment()
        first = {tp: offset for tp, offset in first.items() if tp in assigned}
        if unknown and first:  # the transaction may have committed: the group's offsets say (read_committed)
            tps = list(first)
            committed = self._retry(lambda: self.consumer.committed(tps, self.request_timeout_s), "committed offsets")
            first = {tp: committed[tp] if committed.get(tp, -1) >= 0 else offset for tp, offset in first.items()}
        for (topic, part), offset in first.items():
            try:
                self.consumer.seek(topic, part, offset)
            except ConsumeError as seek_exc:
                if not fenced_member(exc):
                    raise
                raise ConsumeError(  # the consumer, a static member, is fenced too: the caller replaces it
                    f"{why}: the consumer was fenced by another member with the same group.instance.id and "
                    f"cannot seek ({seek_exc}); its replacement reads from the committed offsets",
                    exc.kafka_error,
                ) from exc
        where = ",".join(f"{t}[{p}]@{o}" for (t, p), o in first.items())
        log.warning("%s, rewound %s", why, kv(worker_id=self.worker_id, error=exc, partitions=where))
        return True

    def hand_over(self) -> None:
        """Before partitions leave (a rebalance callback): end the transaction in flight, so none is
        handed over pending. A failed one stays marked for ``rewound``."""
        self.settle()
        if self.in_txn:  # cannot happen (no poll inside an open transaction); abort rather than commit blind
            self.producer.abort_transaction(30)
            self.in_txn = False

    # -- closing ---------------------------------------------------------------------------------
    def close_committer(self, failing: bool) -> None:
        """Let the commit in flight end (not after a failure: a stuck one is left to the fencing of
        ``abort_open``), then stop the commit thread."""
        committer, self._committer = self._committer, None
        if self._txn is not None and not failing:
            self.settle()
        if committer is not None:
            committer.shutdown(wait=not failing, cancel_futures=True)

    def abort_open(self) -> None:
        """Abort a transaction still open (else the broker aborts it at ``transaction.timeout.ms``)."""
        if self.producer is not None and self.in_txn:
            self.in_txn = False
            self.producer.abort_transaction(30)
            log.warning("aborted the open transaction on exit %s", kv(worker_id=self.worker_id))

    def close_producer(self, failing: bool) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            if failing:  # a fenced (fatal) producer cannot even flush; its open transaction is lost anyway
                producer.abandon()
            else:
                producer.close(10)


def _run_now(fn, *args) -> Future:
    """``fn(*args)`` run on this thread, as a finished Future."""
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except Exception as exc:  # handed to settle, like the commit thread's
        f.set_exception(exc)
    return f
