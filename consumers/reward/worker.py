"""The reward worker (``rlstream reward``): a member of the reward consumer group that scores
rollouts into the scored topic exactly once.

Loop: collect a batch (up to ``max_batch_size`` messages or ``max_batch_ms``, closed early after
``batch_idle_ms`` without a new message, or at once when every group in it is whole), decode and
score it
in the pool (no consumer call while scoring), then in ONE Kafka transaction produce a
ScoredTrajectory per good message and a DeadLetter per bad one (undecodable, wrong schema, reward
raised, reward timed out), send the batch's next offsets with the consumer's group metadata, and
commit. The transaction is never open across a consumer poll on the main thread: with
``reward.overlap_commit`` (off by default) the offsets and the commit of batch N run on a commit
thread while the main thread collects and scores batch N+1, and every rebalance callback first
waits for that commit to end, so a partition is never handed over with its transaction pending.
Transaction N+1 begins only once N has committed. If a transaction fails with a non-fatal error it
is aborted and the consumer seeks back to the batch's first offsets (and drops the next batch,
read meanwhile), so nothing is skipped. A worker that stood still past its session timeout
(SIGSTOP, a paused machine) finds its offsets refused when it wakes, since the group gave its
partitions to another member: it aborts, says ``could not commit: ...`` and goes on. A fatal error
(fenced by a newer instance with the same transactional id, or by the broker when the transaction
outlived ``reward.transaction_timeout_ms``) stops the worker, for a restart, with an error that
names both causes. That protocol (begin, produce, offsets, commit, abort and rewind, a wedged
producer replaced, the commit thread) is ``pipeline.kafka.ExactlyOnceLoop``'s; this worker
collects, scores and says what to produce.

What it is not: it never commits offsets outside a transaction and never writes partial batches.
"""

from __future__ import annotations

import logging
import math
import time

from consumers.reward.metrics import RewardMetrics
from libs.rewards.pool import make_pool
from pipeline.control import now_ms
from pipeline.errors import ConsumeError, DecodeError, DeliveryError, KafkaClientError
from pipeline.kafka import Consumer, ExactlyOnceLoop, Producer, client_conf, decode_message
from pipeline.log import kv
from pipeline.records import check_trajectory
from pipeline.topology import transactional_id
from pipeline.worker import Worker

log = logging.getLogger(__name__)
RENEW_WINDOW_S = 600.0
"""``reward.max_consumer_replacements`` counts consumer replacements within this window."""


class RewardWorker(Worker):
    role = "reward"
    unit = "batch"
    txn_loop = ExactlyOnceLoop
    """The exactly-once loop (``pipeline.kafka.txn``); tests put a fault-injecting subclass here."""

    def __init__(self, cfg):
        super().__init__(cfg, cfg.reward.worker_id)
        self.rc = cfg.reward
        self.transactional_id = transactional_id(self.rc.transactional_id_prefix, self.worker_id)
        self.topic_in = cfg.topics.name("rollouts")
        self.topic_out = cfg.topics.name("scored")
        self.topic_dlq = cfg.topics.name("dlq")
        self.topic_metrics = cfg.topics.name("metrics")
        self._buffer: list = []
        self.group_size = cfg.rl.group_size
        """Samples that make a group whole for ``reward.close_whole_groups`` (with
        ``rollout.overprovision`` the tail may never come: the first ``group_size`` make it whole)."""
        self._renewed_at: list[float] = []
        """When the consumer was replaced after a fencing (``_renew_fenced_consumer``)."""
        self.txn: ExactlyOnceLoop | None = None
        self.pool = self.consumer = self.metrics = self._metrics_producer = None
        rc = self.rc  # the longest one batch may take to score: every call timing out, one pool slot at a time
        self._scoring_s = rc.timeout_s * math.ceil(rc.max_batch_size / rc.pool_size) + rc.max_batch_ms / 1000 + 30

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
        self._metrics_producer = Producer(client_conf(cfg, "reward-metrics", self.worker_id, "producer"))
        self.metrics = RewardMetrics(self.worker_id, rc, self._metrics_producer, self.topic_metrics)
        cconf = self._kafka_settings(
            client_conf(cfg, "reward", self.worker_id, "consumer"),
            {
                "session.timeout.ms": rc.session_timeout_ms,
                "heartbeat.interval.ms": rc.heartbeat_ms(),  # a rebalance is noticed within one
                "max.poll.interval.ms": rc.max_poll_interval_ms,
                **({"group.instance.id": rc.group_instance_id} if rc.group_instance_id else {}),
            },
            cfg.kafka.consumer,
        )
        cconf["isolation.level"] = "read_committed"  # never score a rollout that was rolled back
        self.consumer = Consumer(cconf, group_id=rc.group_id)
        pconf = self._kafka_settings(
            client_conf(cfg, "reward", self.worker_id, "producer"),
            {"transaction.timeout.ms": rc.transaction_timeout_ms},
            cfg.kafka.producer,
        )
        self.txn = self.txn_loop(
            self.consumer,
            pconf,
            self.transactional_id,
            request_timeout_s=cfg.kafka.request_timeout_s,
            watchdog_s=self.liveness.watchdog_s,
            outage_s=self.liveness.outage_s,
            overlap=rc.overlap_commit,
            section=self.section,
            retry=self.startup_call,
            committed=self._committed,
            aborted=self._aborted,
            replaced=lambda _exc: self.metrics.m.inc("producers_replaced"),
            stop_left=self.stop_time_left,
            chaos_delay_s=rc.chaos_delay_in_txn_ms / 1000,
            worker_id=self.worker_id,
        )
        self.txn.start()  # init_transactions: fences a zombie with this transactional id
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
        try:
            batch = self._collect()
            if batch and not self.stop_event.is_set():
                self._process(batch)
            else:  # idle (or stopping): end the transaction in flight
                self.txn.settle()
                self.txn.rewound()
        except ConsumeError as exc:  # a poll, or the rewind after a transaction its fencing failed
            if not Consumer.is_fenced_member(exc):
                raise
            self._renew_fenced_consumer(exc)
            return True
        except KafkaClientError as exc:
            if not _fenced_producer(exc):
                raise
            raise KafkaClientError(
                f"could not commit: this worker's transactional producer was fenced (transactional id "
                f"{self.transactional_id!r}): the broker aborted its open transaction, because it stayed open "
                f"past reward.transaction_timeout_ms={self.rc.transaction_timeout_ms} (the process was stopped "
                f"or cut off that long) or because another worker started with the same reward.worker_id; "
                f"exiting so that a restart reads on from the committed offsets (nothing the aborted "
                f"transaction wrote is read) ({exc})",
                exc.kafka_error,
            ) from exc
        self.metrics.maybe_publish()
        self._metrics_producer.poll(0)
        return True

    def keepalive(self) -> None:
        """Inside a long declared section (a producer replaced while the coordinator recovers):
        go on publishing metrics, so the launcher does not take the wait for a hang."""
        mp = self._metrics_producer
        if self.stop_event.is_set() or self.failed or self.metrics is None or mp is None:
            return  # stopping or closing: the shutdown bound applies, and the clients may be closing
        self.metrics.maybe_publish()
        mp.poll(0)

    def _renew_fenced_consumer(self, exc: ConsumeError) -> None:
        """Our static registration was taken by a consumer with our ``group.instance.id`` (librdkafka
        itself, after a broker restart, or another process). End the transaction in flight (its
        offsets carry the fenced membership: it aborts, and is read again), drop what was read,
        and replace the consumer in place: the new member takes the registration back and reads on
        from the committed offsets, so nothing is lost or scored twice. Past the budget another
        live process holds the id: exit with the error."""
        now = time.monotonic()
        self._renewed_at = [t for t in self._renewed_at if now - t < RENEW_WINDOW_S] + [now]
        budget = self.rc.max_consumer_replacements
        if len(self._renewed_at) > budget:
            raise ConsumeError(
                f"fenced as a static member {len(self._renewed_at)} times in {RENEW_WINDOW_S:.0f} s (budget "
                f"reward.max_consumer_replacements={budget}): another live process uses group.instance.id="
                f"{self.rc.group_instance_id!r} in group {self.rc.group_id!r}; give each worker its own "
                f"reward.group_instance_id ({exc})",
                exc.kafka_error,
            ) from exc
        log.warning(
            "static member fenced by its own group.instance.id; replacing the consumer %s",
            kv(worker_id=self.worker_id, instance_id=self.rc.group_instance_id, error=exc),
        )
        self.txn.settle()  # a fatal error here (the producer fenced) ends the worker, as before
        self._buffer = []
        with self.section("replace consumer", self.liveness.outage_s + 60):
            self.consumer.renew()
        self.txn.rewound()  # the new member reads from the committed offsets: nothing to seek
        self.metrics.m.inc("consumers_replaced")

    def finish(self) -> None:
        """A stop: let the transaction in flight commit (a failed one is read again by the next owner)."""
        if self.txn is not None:
            self.txn.settle()

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
        if self.txn is not None:
            self.txn.close_committer(failing)

    def _abort_on_exit(self, failing: bool) -> None:
        if self.txn is not None:
            self.txn.abort_open()

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
        if mp is not None:
            # a stop's close gets a third of what is left of its bound (the chaos run: a leaving worker
            # spent 22 s of its 30 s on an outage's fence, then a 10 s flush of the queued metric events
            # ran past the bound: exit 75, a hang); what does not fit is dropped
            left = self.stop_time_left()
            wait = 10.0 if left is None else min(10.0, left / 3)
            try:
                if wait >= 0.5:
                    mp.close(wait)
                elif dropped := mp.discard():
                    log.warning("metric events dropped: no time left of the stop bound %s", kv(events=dropped))
            except DeliveryError as exc:  # metrics are best effort: a stop during an outage drops them
                log.warning("metric events not delivered before stopping %s", kv(error=exc))
        if self.txn is not None:
            self.txn.close_producer(failing)

    # -- rebalance callbacks (called from inside consume()) -------------------------------------
    def _on_assign(self, consumer, partitions) -> None:
        log.info("partitions assigned %s", kv(worker_id=self.worker_id, partitions=_fmt(partitions)))

    def _on_revoke(self, consumer, partitions) -> None:
        self._drop(partitions, "revoked")

    def _on_lost(self, consumer, partitions) -> None:
        self._drop(partitions, "lost")

    def _drop(self, partitions, why: str) -> None:
        self.txn.hand_over()  # a partition leaves only once the commit in flight has ended (committed or aborted)
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
        fill. The batch closes early once ``batch_idle_ms`` passes without a new message, or (with
        ``close_whole_groups``) at once when nothing more is fetched and every group in it is whole;
        with ``batch_idle_ms`` 0 it fills or waits out ``max_batch_ms``.
        Waits are polls, which return at the first message: a batch-sized ``consume`` would wait
        out its whole timeout unless the batch filled."""
        rc = self.rc
        self._buffer = []
        wait = rc.idle_poll_s
        if self.txn.committing:  # overlap_commit: with nothing to read at once, end the commit in flight now
            wait = min(wait, max(rc.batch_idle_ms, 1) / 1000)  # (run_once settles), not after an idle poll:
        first = self.consumer.poll(wait)  # the trainer waits for it (k = 0: +0.35 s a step, bench trace)
        if first is not None:
            self._keep([first])
            self.metrics.consumed()
        last = time.monotonic()  # the newest message's arrival
        deadline = last + rc.max_batch_ms / 1000
        idle_s = rc.batch_idle_ms / 1000
        while self._buffer and not self.stop_event.is_set() and len(self._buffer) < rc.max_batch_size:
            now = time.monotonic()
            wait = min(deadline - now, last + idle_s - now if idle_s else rc.idle_poll_s)
            if wait <= 0:  # max_batch_ms, or batch_idle_ms without a new message
                break
            got = self.consumer.consume(rc.max_batch_size - len(self._buffer), 0)  # already fetched
            if not got:
                if idle_s and rc.close_whole_groups and whole_groups(self._buffer, self.group_size):
                    break
                m = self.consumer.poll(min(wait, rc.idle_poll_s))  # short waits: a stop is seen within one
                got = [m] if m is not None else []
            if got:
                self._keep(got)
                last = time.monotonic()
        batch, self._buffer = self._buffer, []
        return batch

    def _keep(self, msgs: list) -> None:
        """Buffer messages of partitions still assigned (a revoke inside poll may have removed some)."""
        if msgs:
            assigned = self.consumer.assignment()
            self._buffer.extend(m for m in msgs if (m.topic(), m.partition()) in assigned)

    def _process(self, batch: list) -> None:
        if self.txn.rewound(batch):  # a rebalance callback found the previous transaction failed
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
        # the commit of the batch before overlapped the scoring above; write() ends it first
        self.txn.write(batch, lambda: self._produce_results(good, bad, outcomes))

    def _produce_results(self, good, bad, outcomes) -> tuple[list, list]:
        """Inside the batch's transaction: a ScoredTrajectory per scored rollout, a DeadLetter per bad
        one. Returns what the metrics count once it commits: (task, reward, latency_ms) and
        (error_type, latency_ms) lists."""
        scored, dead = [], []
        for (m, traj), out in zip(good, outcomes, strict=True):
            if out.ok:
                self._produce_scored(m, traj, out)
                scored.append((traj["task"], out.reward, out.latency_ms))
            else:
                bad.append((m, out.error_type, out.reason, out.latency_ms))
        for m, error_type, reason, ms in bad:
            self._produce_dead(m, error_type, reason)
            dead.append((error_type, ms))
        return scored, dead

    def _aborted(self, exc: Exception) -> None:
        """A transaction was aborted; one that the group refused says why in one line."""
        self.metrics.aborted()
        if _left_group(exc):
            log.warning(
                "could not commit: the group moved this worker's partitions to another member while it "
                "was stopped or cut off past reward.session_timeout_ms; its transaction is aborted "
                "(nothing it wrote is read), the new owner scores the batch, and this worker goes on "
                "with what the group assigns it now %s",
                kv(worker_id=self.worker_id, session_timeout_ms=self.rc.session_timeout_ms, error=exc),
            )

    def _committed(self, result: tuple[list, list], txn_ms: float) -> None:
        scored, dead = result
        self.metrics.committed(scored, dead, txn_ms)

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
        self.txn.produce_record(self.topic_out, "ScoredTrajectory", rec, key=key)

    def _produce_dead(self, m, error_type: str, reason: str) -> None:
        self.txn.produce_record(self.topic_dlq, "DeadLetter", self.dead_letter(m, error_type, reason), key=m.key())
        log.warning(
            "sent to DLQ %s",
            kv(error_type=error_type, partition=m.partition(), offset=m.offset(), reason=reason[:200]),
        )


def whole_groups(msgs: list, group_size: int) -> bool:
    """Has every group among ``msgs`` (by message key: the group id) at least ``group_size``
    messages? False if a message has no key (its group is unknown)."""
    counts: dict[bytes, int] = {}
    for m in msgs:
        key = m.key()
        if key is None:
            return False
        counts[key] = counts.get(key, 0) + 1
    return all(n >= group_size for n in counts.values())


GROUP_REFUSALS = frozenset({"UNKNOWN_MEMBER_ID", "ILLEGAL_GENERATION", "FENCED_MEMBER_EPOCH", "STALE_MEMBER_EPOCH"})
"""Answers of the group coordinator to a transaction's offsets from a member it no longer knows at
that generation (classic protocol) or member epoch (KIP-848): its partitions are someone else's."""


def _fenced_producer(exc: BaseException) -> bool:
    """The transactional producer was fenced: its epoch was bumped by a newer producer with its
    transactional id, or by the broker when its transaction timed out."""
    ke = getattr(exc, "kafka_error", None)
    return ke is not None and ke.name() in ("PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH", "_FENCED")


def _left_group(exc: BaseException) -> bool:
    ke = getattr(exc, "kafka_error", None)
    return ke is not None and ke.name() in GROUP_REFUSALS


def _fmt(partitions) -> str:
    return ",".join(f"{tp.topic}[{tp.partition}]" for tp in partitions)


def run(cfg, stop=None) -> None:
    """Entry point of ``rlstream reward``."""
    RewardWorker(cfg).run(stop)
