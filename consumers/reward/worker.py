"""The reward worker (``rlstream reward``): a member of the reward consumer group that scores
rollouts into the scored topic exactly once.

Loop: collect a batch (up to ``max_batch_size`` messages or ``max_batch_ms``, closed early after
``batch_idle_ms`` without a new message), decode and score it
in the pool (no consumer call while scoring), then in ONE Kafka transaction produce a
ScoredTrajectory per good message and a DeadLetter per bad one (undecodable, wrong schema, reward
raised, reward timed out), send the batch's next offsets with the consumer's group metadata, and
commit. The transaction is never open across a consumer poll on the main thread: with
``reward.overlap_commit`` (off by default) the offsets and the commit of batch N run on a commit
thread while the main thread collects and scores batch N+1, and every rebalance callback first
waits for that commit to end, so a partition is never handed over with its transaction pending.
Transaction N+1 begins only once N has committed. If a transaction fails with a non-fatal error it
is aborted and the consumer seeks back to the batch's first offsets (and drops the next batch,
read meanwhile), so nothing is skipped. A fatal error (e.g. fenced by a newer instance with the
same transactional id) stops the worker with an error.

What it is not: it never commits offsets outside a transaction and never writes partial batches.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from consumers.reward.metrics import RewardMetrics
from consumers.reward.pool import make_pool
from pipeline.control import now_ms
from pipeline.errors import DecodeError, DeliveryError, KafkaClientError
from pipeline.kafka import Consumer, Producer, WedgedClient, client_conf, decode_message, next_offsets
from pipeline.log import kv
from pipeline.records import check_trajectory
from pipeline.topology import transactional_id
from pipeline.worker import Worker

log = logging.getLogger(__name__)


@dataclass
class _Txn:
    """A transaction whose batch is produced; its offsets and commit run on the commit thread."""

    batch: list
    scored: list
    dead: list
    t0: float
    checkpointed: threading.Event = field(default_factory=threading.Event)
    """Set once the commit thread is past the fault-injection pause (``chaos_delay_in_txn_ms``)."""
    future: Future | None = None


class RewardWorker(Worker):
    role = "reward"
    unit = "batch"

    def __init__(self, cfg):
        super().__init__(cfg, cfg.reward.worker_id)
        self.rc = cfg.reward
        self.transactional_id = transactional_id(self.rc.transactional_id_prefix, self.worker_id)
        self.topic_in = cfg.topics.name("rollouts")
        self.topic_out = cfg.topics.name("scored")
        self.topic_dlq = cfg.topics.name("dlq")
        self.topic_metrics = cfg.topics.name("metrics")
        self._buffer: list = []
        self._in_txn = False
        self._txn: _Txn | None = None
        """The produced transaction whose commit is in flight (at most one)."""
        self._rewind_due: tuple[list, Exception, str] | None = None
        """A failed transaction's batch, to be read again (with whatever was read after it)."""
        self._committer: ThreadPoolExecutor | None = None
        self.pool = self.producer = self.consumer = self.metrics = self._metrics_producer = None
        rc = self.rc  # the longest one batch may take to score: every call timing out, one pool slot at a time
        self._scoring_s = rc.timeout_s * math.ceil(rc.max_batch_size / rc.pool_size) + rc.max_batch_ms / 1000 + 30
        # The watchdog's limit of one transaction call: the last resort behind the wrapper's own bound
        # (pipeline.kafka.WedgedClient: librdkafka #5456 can block send_offsets_to_transaction forever).
        self._txn_call_s = cfg.kafka.request_timeout_s + 30  # past the wrapper's own bound (+15 s)
        self._commit_wait_s = self._txn_call_s * 11  # send_offsets, then up to 10 commit attempts

    def _kafka_settings(self, base: dict, settings: dict, user: dict) -> dict:
        """Role settings under the user's explicit ``kafka.*`` extras, which win."""
        conf = dict(base)
        for k, v in settings.items():
            if k not in user and k not in self.cfg.kafka.common:
                conf[k] = v
        return conf

    def _check_topics(self) -> None:
        """Wait (up to ``liveness.startup_timeout_s``) for the topics to exist; TopicError names a
        missing one, or one this principal may not use."""
        with Consumer(client_conf(self.cfg, "reward-check", self.worker_id, "consumer")) as probe:
            for topic in (self.topic_in, self.topic_out, self.topic_dlq, self.topic_metrics):
                self.startup_call(
                    lambda t=topic: probe.partitions(t, self.cfg.kafka.request_timeout_s), f"topic {topic}"
                )

    def setup(self) -> None:
        cfg, rc = self.cfg, self.rc
        path = self.write_resolved()
        self.pool = make_pool(rc, cfg.log_level)  # first: a reward that cannot be built is a ConfigError now
        self._check_topics()
        if rc.overlap_commit:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="reward-commit")
        pconf = self._kafka_settings(
            client_conf(cfg, "reward", self.worker_id, "producer"),
            {"transaction.timeout.ms": rc.transaction_timeout_ms},
            cfg.kafka.producer,
        )
        self._pconf = pconf
        self._new_producer()
        self._metrics_producer = Producer(client_conf(cfg, "reward-metrics", self.worker_id, "producer"))
        self.metrics = RewardMetrics(self.worker_id, rc, self._metrics_producer, self.topic_metrics)
        cconf = self._kafka_settings(
            client_conf(cfg, "reward", self.worker_id, "consumer"),
            {
                "session.timeout.ms": rc.session_timeout_ms,
                "heartbeat.interval.ms": max(100, rc.session_timeout_ms // 4),
                "max.poll.interval.ms": rc.max_poll_interval_ms,
                **({"group.instance.id": rc.group_instance_id} if rc.group_instance_id else {}),
            },
            cfg.kafka.consumer,
        )
        cconf["isolation.level"] = "read_committed"  # never score a rollout that was rolled back
        self.consumer = Consumer(cconf, group_id=rc.group_id)
        self.consumer.subscribe(
            [self.topic_in], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        log.info(
            "reward worker started %s",
            kv(
                worker_id=self.worker_id,
                transactional_id=self.transactional_id,
                group=rc.group_id,
                static_member=rc.group_instance_id or "-",
                topic=self.topic_in,
                executor=rc.executor,
                pool_size=rc.pool_size,
                overlap_commit=rc.overlap_commit,
                config=path,
            ),
        )
        if rc.worker_id and not rc.group_instance_id:
            log.info(
                "dynamic membership: if this worker is killed, its partitions wait out the session timeout "
                "before another worker gets them; for a restart that keeps them, also set "
                "reward.group_instance_id %s",
                kv(suggested=rc.worker_id, session_timeout_ms=rc.session_timeout_ms),
            )

    def run_once(self) -> bool:
        """Score one batch in one transaction (a stop drops an unscored batch, never commits it)."""
        batch = self._collect()
        if batch and not self.stop_event.is_set():
            self._process(batch)
        else:  # idle (or stopping): end the transaction in flight
            self._settle()
            self._rewound([])
        self.metrics.maybe_publish()
        self._metrics_producer.poll(0)
        return True

    def finish(self) -> None:
        """A stop: let the transaction in flight commit (a failed one is read again by the next owner)."""
        self._settle()

    def close(self) -> None:
        """Wait for the commit in flight, abort an open transaction, leave the group, stop the pool,
        publish final metrics, flush. After a failure a closing step that fails is logged, not raised."""
        failing = self.failed
        steps = [
            ("commit thread", self._close_committer),
            ("abort", self._abort_on_exit),
            ("consumer", self._close_consumer),  # leaves the group (a static member keeps its slot)
            ("pool", self._close_pool),
            ("metrics", self._close_metrics),
            ("producers", self._close_producers),
        ]
        for name, step in steps:
            try:
                step(failing)
            except Exception as exc:
                if not failing:
                    raise
                log.warning("error while closing %s", kv(step=name, error=f"{type(exc).__name__}: {exc}"))
        log.info("reward worker stopped %s", kv(worker_id=self.worker_id))

    def _close_committer(self, failing: bool) -> None:
        committer, self._committer = self._committer, None
        if self._txn is not None and not failing:
            self._settle()
        if committer is not None:  # after a failure a stuck commit is left to _abort_on_exit's fencing
            committer.shutdown(wait=not failing, cancel_futures=True)

    def _abort_on_exit(self, failing: bool) -> None:
        if self.producer is not None and self._in_txn:
            self._in_txn = False
            self.producer.abort_transaction(30)  # else the broker aborts it at transaction.timeout.ms
            log.warning("aborted the open transaction on exit %s", kv(worker_id=self.worker_id))

    def _close_consumer(self, failing: bool) -> None:
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            consumer.close()

    def _close_pool(self, failing: bool) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def _close_metrics(self, failing: bool) -> None:
        # Final snapshot; the object stays readable after close. No metrics producer: already closed.
        if self.metrics is not None and self._metrics_producer is not None:
            try:
                self.metrics.publish()
            finally:
                self.metrics.close()

    def _close_producers(self, failing: bool) -> None:
        mp, self._metrics_producer = self._metrics_producer, None
        tp, self.producer = self.producer, None
        if mp is not None:
            try:
                mp.close(10)
            except DeliveryError as exc:  # metrics are best effort: a stop during an outage drops them
                log.warning("metric events not delivered before stopping %s", kv(error=exc))
        if tp is not None:
            if failing:  # a fenced (fatal) producer cannot even flush; its open transaction is lost anyway
                tp.abandon()
            else:
                tp.close(10)

    # -- rebalance callbacks (called from inside consume()) -------------------------------------
    def _on_assign(self, consumer, partitions) -> None:
        log.info("partitions assigned %s", kv(worker_id=self.worker_id, partitions=_fmt(partitions)))

    def _on_revoke(self, consumer, partitions) -> None:
        self._drop(partitions, "revoked")

    def _on_lost(self, consumer, partitions) -> None:
        self._drop(partitions, "lost")

    def _drop(self, partitions, why: str) -> None:
        self._settle()  # a partition leaves only once the commit in flight has ended (committed or aborted)
        if self._in_txn:  # cannot happen (no poll inside an open transaction); abort rather than commit blind
            self.producer.abort_transaction(30)
            self._in_txn = False
        gone = {(tp.topic, tp.partition) for tp in partitions}
        before = len(self._buffer)
        self._buffer = [m for m in self._buffer if (m.topic(), m.partition()) not in gone]
        log.info(
            "partitions %s %s",
            why,
            kv(worker_id=self.worker_id, partitions=_fmt(partitions), dropped=before - len(self._buffer)),
        )

    # -- the loop -------------------------------------------------------------------------------
    def _collect(self) -> list:
        """Up to max_batch_size messages: wait idle_poll_s for a first one, then up to max_batch_ms to
        fill, in windows of batch_idle_ms; a window that brings nothing closes the batch."""
        rc = self.rc
        self._buffer = []
        first = self.consumer.poll(rc.idle_poll_s)
        if first is not None:
            self._keep([first])
            self.metrics.consumed()
        deadline = time.monotonic() + rc.max_batch_ms / 1000
        idle_s = rc.batch_idle_ms / 1000
        while self._buffer and not self.stop_event.is_set() and len(self._buffer) < rc.max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            window = min(remaining, idle_s or rc.idle_poll_s)  # short windows: a stop is seen within one
            got = self.consumer.consume(rc.max_batch_size - len(self._buffer), window)
            self._keep(got)
            if idle_s and not got:
                break
        batch, self._buffer = self._buffer, []
        return batch

    def _keep(self, msgs: list) -> None:
        """Buffer messages of partitions still assigned (a revoke inside poll may have removed some)."""
        if msgs:
            assigned = self.consumer.assignment()
            self._buffer.extend(m for m in msgs if (m.topic(), m.partition()) in assigned)

    def _process(self, batch: list) -> None:
        if self._rewound(batch):  # a rebalance callback found the previous transaction failed
            return
        good, bad = [], []  # (msg, trajectory) / (msg, error_type, reason, latency_ms)
        for m in batch:
            try:
                traj = decode_message(m, "Trajectory")
                check_trajectory(traj)  # versions, finite logprobs, lengths, sizes
                good.append((m, traj))
            except DecodeError as exc:  # undecodable, wrong schema, or nonsense (InvalidRecord)
                bad.append((m, exc.error_type, str(exc), 0.0))
        with self.section("scoring", self._scoring_s):
            outcomes = self.pool.score([t for _, t in good])
        self._settle()  # transaction N ends (its commit overlapped the work above) before N+1 begins
        if self._rewound(batch):
            return
        self._start_txn(batch, good, bad, outcomes)
        if self._committer is None:
            self._settle()
            self._rewound([])

    def _new_producer(self) -> None:
        """The transactional producer; ``init_transactions`` fences (and aborts the open transaction
        of) any earlier producer with the same transactional id: a zombie, or a wedged one."""
        self.producer = Producer(self._pconf, transactional_id=self.transactional_id)
        init_s = max(60.0, self.rc.transaction_timeout_ms / 1000 + 30)
        self.startup_call(lambda: self.producer.init_transactions(init_s), "init_transactions")

    def _replace_wedged_producer(self, exc: WedgedClient) -> None:
        """librdkafka blocked for good in a transaction call (after a broker restart): park that
        client and start a new producer (whose init_transactions aborts the stuck transaction on the
        broker), in this process: no restart, no rebalance. The caller rewinds."""
        log.warning("transactional producer stuck; replacing it %s", kv(worker_id=self.worker_id, error=exc))
        self.metrics.m.inc("producers_replaced")
        self._in_txn = False
        with self.section("replace producer", self.liveness.outage_s + 60):
            self._new_producer()

    def _start_txn(self, batch, good, bad, outcomes) -> None:
        """Begin the batch's transaction and produce its results; its offsets and commit then run on
        the commit thread (inline without ``reward.overlap_commit``) until ``_settle``."""
        self.producer.begin_transaction()
        txn = self._txn = _Txn(batch, [], [], time.perf_counter())
        self._in_txn = True
        try:
            for (m, traj), out in zip(good, outcomes, strict=True):
                if out.ok:
                    self._produce_scored(m, traj, out)
                    txn.scored.append((traj["task"], out.reward, out.latency_ms))
                else:
                    bad.append((m, out.error_type, out.reason, out.latency_ms))
            for m, error_type, reason, ms in bad:
                self._produce_dead(m, error_type, reason)
                txn.dead.append((error_type, ms))
        except Exception as exc:  # e.g. an earlier delivery error, raised on produce: _settle aborts
            txn.future = Future()
            txn.future.set_exception(exc)
        else:
            if self._committer is not None:
                txn.future = self._committer.submit(self._end_txn, txn, _unwatched)
            else:
                txn.future = _run_now(self._end_txn, txn, self.section)
        txn.future.add_done_callback(lambda _: txn.checkpointed.set())  # also if it failed before it

    def _end_txn(self, txn: _Txn, watch) -> None:
        """Add the batch's offsets and commit. Every call is bounded by pipeline.kafka.WedgedClient;
        inline, ``watch`` declares watchdog sections; on the commit thread it is a no-op (sections
        belong to the main thread, whose wait in ``_settle`` is watched)."""
        try:
            with watch("transaction", self.liveness.watchdog_s):
                self._txn_checkpoint(txn.batch)
        finally:
            txn.checkpointed.set()
        with watch("send_offsets_to_transaction", self._txn_call_s):
            self.producer.send_offsets_to_transaction(  # milliseconds normally; bounded short (+ grace)
                next_offsets(txn.batch), self.consumer, min(10.0, self.cfg.kafka.request_timeout_s)
            )
        self._commit(watch)

    def _commit(self, watch) -> None:
        for attempt in range(10):
            try:
                with watch("commit_transaction", self._txn_call_s):
                    self.producer.commit_transaction(self.cfg.kafka.request_timeout_s)
                return
            except KafkaClientError as exc:
                ke = exc.kafka_error
                if ke is None or not ke.retriable() or ke.fatal() or ke.txn_requires_abort() or attempt == 9:
                    raise
                log.warning("retrying commit %s", kv(error=exc, attempt=attempt + 1))

    def _settle(self) -> None:
        """Wait for the transaction in flight to end. Committed: counted. Failed: aborted (or the
        stuck producer replaced) and its batch marked to be read again (``_rewound``). Fatal: raised."""
        txn, self._txn = self._txn, None
        if txn is None:
            return
        with self.section("transaction", self.liveness.watchdog_s):
            txn.checkpointed.wait(self.rc.chaos_delay_in_txn_ms / 1000 + self._commit_wait_s)
        with self.section("commit_transaction", self._commit_wait_s):
            try:
                exc = txn.future.exception(self._commit_wait_s)
            except TimeoutError:
                raise RuntimeError(
                    f"the commit thread did not end a transaction within {self._commit_wait_s:.0f} s"
                ) from None
        if exc is None:
            self._in_txn = False
            self.metrics.committed(txn.scored, txn.dead, (time.perf_counter() - txn.t0) * 1000)
            log.debug(
                "transaction committed %s", kv(worker_id=self.worker_id, scored=len(txn.scored), dlq=len(txn.dead))
            )
            return
        if isinstance(exc, WedgedClient):
            self._replace_wedged_producer(exc)
            why = "producer replaced"
        elif isinstance(exc, KafkaClientError) and not exc.fatal:
            self._abort(exc)
            why = "transaction aborted"
        else:
            raise exc  # fenced or otherwise unusable: exit; a restart (same id) recovers cleanly
        self._rewind_due = (txn.batch, exc, why)

    def _rewound(self, batch: list) -> bool:
        """If a transaction failed: read its batch and ``batch`` (read after it) again. True if so."""
        if self._rewind_due is None:
            return False
        failed, exc, why = self._rewind_due
        self._rewind_due = None
        self._rewind(failed + batch, exc, why)
        return True

    def _txn_checkpoint(self, batch: list) -> None:
        log.debug("transaction open %s", kv(worker_id=self.worker_id, batch=len(batch)))
        if self.rc.chaos_delay_in_txn_ms:
            self.producer.flush(self.cfg.kafka.request_timeout_s)  # the records really are on the broker
            time.sleep(self.rc.chaos_delay_in_txn_ms / 1000)

    def _abort(self, exc: Exception) -> None:
        deadline = time.monotonic() + self.liveness.outage_s
        while True:  # a broker outage can make the abort itself fail for a while: ride it out
            try:
                with self.section("abort_transaction", self._txn_call_s):
                    self.producer.abort_transaction(self.cfg.kafka.request_timeout_s)
                break
            except KafkaClientError as abort_exc:
                if abort_exc.fatal or not abort_exc.retriable or time.monotonic() > deadline:
                    raise
                log.warning("abort failed, retrying %s", kv(error=abort_exc))
                time.sleep(1.0)
        self._in_txn = False
        self.metrics.aborted()

    def _rewind(self, batch: list, exc: Exception, why: str) -> None:
        """Seek every still-assigned partition of ``batch`` back to its first offset (nothing skipped)."""
        first: dict[tuple[str, int], int] = {}
        for m in batch:
            key = (m.topic(), m.partition())
            first[key] = min(first.get(key, m.offset()), m.offset())
        assigned = self.consumer.assignment()
        for (topic, part), offset in first.items():
            if (topic, part) in assigned:
                self.consumer.seek(topic, part, offset)
        log.warning(
            "%s, rewound %s",
            why,
            kv(
                worker_id=self.worker_id, error=exc, partitions=",".join(f"{t}[{p}]@{o}" for (t, p), o in first.items())
            ),
        )

    def _produce_scored(self, m, traj: dict, out) -> None:
        rec = {  # the trajectory travels as the exact bytes read, never re-encoded (ScoredTrajectory.v2)
            "trajectory": None,
            "trajectory_value": m.value(),
            "reward": out.reward,
            "reward_details": out.details,
            "scorer_id": self.worker_id,
            "scored_at_ms": now_ms(),
            "score_latency_ms": out.latency_ms,
            "source_partition": m.partition(),
            "source_offset": m.offset(),
        }
        key = m.key() if m.key() is not None else traj["group_id"].encode()
        self.producer.produce_record(self.topic_out, "ScoredTrajectory", rec, key=key)

    def _produce_dead(self, m, error_type: str, reason: str) -> None:
        self.producer.produce_record(self.topic_dlq, "DeadLetter", self.dead_letter(m, error_type, reason), key=m.key())
        log.warning(
            "sent to DLQ %s",
            kv(error_type=error_type, partition=m.partition(), offset=m.offset(), reason=reason[:200]),
        )


def _run_now(fn, *args) -> Future:
    """``fn(*args)`` run on this thread, as a finished Future."""
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except Exception as exc:  # handed to _settle, like the commit thread's
        f.set_exception(exc)
    return f


def _unwatched(what: str, seconds: float):
    """No watchdog section (the commit thread's stand-in for ``section``)."""
    return contextlib.nullcontext()


def _fmt(partitions) -> str:
    return ",".join(f"{tp.topic}[{tp.partition}]" for tp in partitions)


def run(cfg, stop=None) -> None:
    """Entry point of ``rlstream reward``."""
    RewardWorker(cfg).run(stop)
