"""The trainer consumer: reads rl.scored (read_committed), assembles GRPO groups, trains one step
per G closed groups, writes versioned weights and announces them on rl.control.

Per trainer step (version ``v`` -> ``v + 1``):
  1. take the next G closed groups (complete, or incomplete past ``group_timeout_s``) in the order
     of ``trainer.group_order`` or a replay schedule (``selection.py``); with ``dynamic_sampling``
     groups whose rewards have zero variance are filtered first (they do not count towards G; they
     are counted, logged with the step, and reported to the producers as consumed:
     ``groups_consumed`` progress records and ``WeightUpdate.consumed_groups``);
  2. ``batch.plan_step``: drop samples with ``v - version_min > k`` (counted as ``stale_dropped``;
     with ``rl.staleness_rule = "token"`` only the tokens older than ``v - k`` are masked, and only a
     sample with nothing trainable left is dropped), apply the incomplete-group policy, compute
     advantages, mask truncated samples (``overlong_filter``);
  3. the engine runs ``minibatches`` optimizer steps over the remaining samples;
  4. every ``publish_every`` steps: weights (full, or the LoRA adapter) -> ``publish.write_version``, engine checkpoint,
     steps log, then the pointer (version, step, offsets, trained group ids) atomically, and only
     then the WeightUpdate on rl.control; offsets are also committed to Kafka for lag visibility.
A restart loads the pointer, seeks each partition of rl.scored to its floor (``assign``, not the
group's committed offsets) and skips the disposed offsets above it (``assembler.OffsetTracker``),
and re-publishes the pointer's WeightUpdate if the crash came before it reached rl.control.

Under torchrun / the deepspeed launcher rank 0 does all Kafka I/O and broadcasts each step's
samples; every rank trains its shard. Not a reward worker or a rollout follower.
"""

from __future__ import annotations

import logging
import time

from consumers.trainer.accounting import account_step
from consumers.trainer.advantages import build_advantage
from consumers.trainer.assembler import GroupAssembler, OffsetTracker
from consumers.trainer.batch import informative, plan_step, sample_from_record
from consumers.trainer.engines import TrainContext, build_engine
from consumers.trainer.engines.base import barrier, broadcast_object, close_dist, dist_env
from consumers.trainer.heartbeat import StepHeartbeat
from consumers.trainer.losses import LossFn
from consumers.trainer.publish import start_signer, write_version
from consumers.trainer.selection import ArrivalSelector, ScheduleSelector, SequenceSelector
from consumers.trainer.standby import wait_for_lock
from consumers.trainer.state import TrainerCheckpoints, restore, trainer_root
from consumers.trainer.step import train_samples
from pipeline.checkpoint import gc_versions, model_fingerprint, read_bytes_verified, write_weights
from pipeline.control import ControlFollower, now_ms, publish_progress, publish_weight_update
from pipeline.errors import ConfigError, DecodeError, KafkaClientError, RlstreamError
from pipeline.kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition, client_conf, decode_message
from pipeline.log import kv
from pipeline.metrics import WorkerMetrics
from pipeline.models import load_model, materialize
from pipeline.notice_auth import NoticeSigner
from pipeline.store_guard import StoreGuard
from pipeline.worker import Worker

log = logging.getLogger(__name__)


def tail_step_note(cfg) -> str | None:
    """With the trained tail (``rollout.overprovision_tail = "train"``) a group is drawn
    ``group_size + m`` strong and a step of ``rl.groups_per_step`` groups trains their tails too:
    say how large, and which settings keep the default rule's step size (on the real-model recipe
    the larger steps trained less well per sample; docs/reference/rollout.md)."""
    ro, n, g = cfg.rollout, cfg.rl.group_size, cfg.rl.groups_per_step
    if ro.overprovision_tail != "train":
        return None
    m = ro.overprovision
    keep = max(1, round(g * n / (n + m)))
    note = (
        f"trained tail: a step trains up to {g * (n + m)} samples ({g} groups of {n} + {m}); "
        f"rl.groups_per_step={keep} keeps about the default rule's {g * n}"
    )
    if n - m >= 2:  # a quorum of one has no group baseline
        note += f", rl.group_size={n - m} keeps its {n} draws a prompt and {g * n} a step"
    return note + " (docs/reference/rollout.md)"


class Trainer(Worker):
    role = "trainer"
    unit = "step"
    stops_itself = True  # rank 0 decides and broadcasts the stop, so no collective is left half-done

    def __init__(self, cfg, max_steps: int | None = None, schedule: list | None = None):
        """``schedule``: a replay's ``selection.ScheduledStep`` list; the trainer then takes exactly
        those groups per step and stops at its end."""
        super().__init__(cfg, cfg.trainer.trainer_id)
        tc = self.tc = cfg.trainer
        self.k, self.G = cfg.rl.max_staleness, cfg.rl.groups_per_step
        self.max_steps = tc.max_steps if max_steps is None else max_steps
        self.schedule = schedule
        if schedule is not None:
            self.max_steps = min(self.max_steps or len(schedule), len(schedule))
        if tc.publish_every > self.k + 1:
            raise ConfigError(
                f"trainer.publish_every={tc.publish_every} needs rl.max_staleness >= {tc.publish_every - 1}: "
                "producers admit groups by the published version, so a larger interval would deadlock"
            )
        self.rank, self.world, _ = dist_env()
        if tc.standby and self.world > 1:
            raise ConfigError("trainer.standby: one process per trainer only (not under torchrun or deepspeed)")
        self.root = trainer_root(cfg)
        self.ckpts = TrainerCheckpoints(self.root)
        self.ckpts.guard = StoreGuard(cfg.liveness, self)  # a full disk or failing store: paused, said, retried
        self._lock = None
        self.producer = self.consumer = self.metrics = None
        self.step_beat: StepHeartbeat | None = None  # rank 0: in-step progress on rl.metrics
        self.step = self.version = 0
        self._closed = False
        self._last_commit: list | None = None  # the floors last committed to the consumer group
        self.signer: NoticeSigner | None = None  # signs this trainer's notices (pipeline.notice_auth)

    def wait_turn(self) -> None:
        """One trainer per checkpoint dir: its lock, which the OS frees on kill -9. A standby
        (``trainer.standby``) waits here for it (``standby.wait_for_lock``)."""
        if self.rank == 0 and self.tc.standby:  # else setup takes the lock, or fails at once if held
            self._lock = wait_for_lock(self)

    def setup(self) -> None:
        cfg, tc = self.cfg, self.tc
        if self.rank == 0:
            if self._lock is None:
                self._lock = self.ckpts.lock()
            self.write_resolved("trainer")
        model_dir = materialize(cfg.model)
        self.engine = build_engine(tc.engine, TrainContext(model_dir, tc))
        self.rank, self.world = self.engine.rank, self.engine.world_size
        mcfg = self.engine.model_config  # what only the trainer can check: ids and lengths
        self._vocab = getattr(mcfg, "vocab_size", None)
        self._max_len = getattr(mcfg, "max_position_embeddings", None)
        if tc.packing:
            check_packing(mcfg)
        self.ref = None
        if tc.loss.kl_coef > 0:
            self.ref = load_model(model_dir, device=str(self.engine.device)).eval().requires_grad_(False)
        self.loss_fn = LossFn(tc.loss)  # a user loss or estimator that cannot be built fails here, at start
        build_advantage(tc.advantage)
        self.version = self.step = 0
        self._pending_log: list[dict] = []
        self._base_sha = (
            model_fingerprint(model_dir) if self.engine.weights_kind == "adapter" and self.rank == 0 else ""
        )
        ptr, older, self._newest_version = restore(self.ckpts, self.engine, self.rank, self.world)
        self._records = [*older, ptr] if ptr else []  # the kept checkpoints' records, oldest first
        if ptr:
            self.version, self.step = int(ptr["version"]), int(ptr["step"])
        fell_back = self._newest_version > self.version  # the same on every rank (broadcast)
        # admission accounting (pipeline.control): groups consumed by committed steps, and the
        # published version's count plus the groups filtered since (what producers admit from)
        self.consumed = int(ptr.get("consumed_groups", self.version * self.G)) if ptr else 0
        self._published = (self.version, self.consumed)
        self._filtered: list = []  # groups filtered by dynamic sampling, waiting for the next step
        self._tails: list = []  # tail samples the step being planned trains (assembler.Tail)
        self._filtered_since_pub = 0
        self._progress_sent = self.consumed
        log.info("trainer state %s", kv(rank=self.rank, version=self.version, step=self.step, resumed=bool(ptr)))
        if self.rank == 0 and (note := tail_step_note(cfg)):
            log.info("%s", note)
        if self.rank == 0:
            cut = self.ckpts.truncate_steps(self.step)
            if cut:
                log.info("cut steps-log lines of lost work %s", kv(lines=cut, after_step=self.step))
            self._setup_kafka(ptr)  # may move self.version on past announced versions after a fallback
        if fell_back:  # rank 0 may have moved the version on past announced ones
            self.version = broadcast_object(self.version if self.rank == 0 else None, self.world)

    # ---- Kafka (rank 0) --------------------------------------------------------------------
    def _setup_kafka(self, ptr: dict | None) -> None:
        cfg, tc, wid = self.cfg, self.tc, self.tc.trainer_id
        self.topic = cfg.topics.name("scored")
        self.offsets = OffsetTracker(ptr["offsets"] if ptr else None)
        self.assembler = GroupAssembler(
            tc.group_timeout_s,
            tc.closed_group_memory,
            ptr["trained_groups"] if ptr else [],
            ptr.get("group_heads") if ptr else None,
        )
        if self.schedule is not None:
            self.selector = ScheduleSelector(self.schedule)
            self.assembler.expect(self.selector.expectations(self.step), self.selector.tail_ids(self.step))
        elif tc.group_order == "sequence":
            self.selector = SequenceSelector(self.G)
        else:
            self.selector = ArrivalSelector(self.G)
        self._at_end = False  # rl.scored read to its end, and nothing read since (selector.needs_end)
        self.producer = Producer(client_conf(cfg, "trainer", wid, kind="producer"))
        self.metrics = WorkerMetrics(
            "trainer",
            wid,
            self.producer,
            cfg.topics.name("metrics"),
            tc.metrics_interval_s,
            tc.prometheus_port,
            labels={"engine": tc.engine.type, "loss": tc.loss.type},
        )
        self.metrics.version = self.version
        beat_conf = client_conf(cfg, "trainer", f"{wid}-progress", kind="producer")
        self.step_beat = StepHeartbeat(self.metrics, Producer(beat_conf), tc.metrics_interval_s)
        for name, value in (ptr or {}).get("counters", {}).items():
            self.metrics.inc(name, value)  # counters are cumulative across restarts
        conf = {**client_conf(cfg, "trainer", wid, kind="consumer"), "on_commit": self._on_commit}
        self.consumer = Consumer(conf, group_id=tc.group_id)
        timeout = cfg.kafka.request_timeout_s
        parts = self.startup_call(lambda: self.consumer.partitions(self.topic, timeout), f"topic {self.topic}")
        starts = self.offsets.start_offsets()
        for p, floor in starts.items():
            low, _ = self.consumer.watermarks(self.topic, p, self.liveness.startup_timeout_s)
            if floor < low:  # retention deleted records this trainer never used: say so, loudly
                log.error("records lost to retention %s", kv(partition=p, floor=floor, log_start=low, lost=low - floor))
                self.metrics.inc("retention_lost", low - floor)
        self.consumer.assign([TopicPartition(self.topic, p, starts.get(p, OFFSET_BEGINNING)) for p in parts])
        self._parts, self._starts = parts, starts
        log.info("consuming %s", kv(topic=self.topic, partitions=len(parts), start={p: starts.get(p) for p in parts}))
        self._reconcile_control(ptr)

    def _reconcile_control(self, ptr: dict | None) -> None:
        """Make rl.control agree with the checkpoint: re-publish its notice if a crash came before it.
        Only this trainer's own notices count (``writer``, and signed with the job's notice key by
        this trainer: ``pipeline.notice_auth``): one it did not write never blocks it."""
        self.signer = start_signer(self.cfg.store, ptr, self.ckpts.guard)
        follower = ControlFollower(self.cfg, "trainer", self.tc.trainer_id, writer=self.tc.trainer_id)
        try:
            latest = follower.catch_up(self.liveness.startup_timeout_s)
        finally:
            follower.close()
        published = latest["version"] if latest else 0
        if self.version < published <= self._newest_version:
            # fell back past announced versions: their weights stay announced; the next versions
            # continue after them (never a version number again with other weights, none skipped)
            log.warning(
                "fallback checkpoint is older than the announced version; numbering continues %s",
                kv(checkpoint_version=self.version, announced=published, next=published + 1),
            )
            self.version = published
            self._published = (self.version, self.consumed)
            self.metrics.version = self.version
        if published > self.version:
            raise RlstreamError(
                f"{self.cfg.topics.name('control')} already announces version {published} but this trainer's checkpoint "
                f"({self.root}) is at version {self.version}; refusing to announce different weights under the same "
                "version (restore the checkpoint dir, or start afresh: a new topics.prefix, or for `rlstream run` a new "
                "job.name; `rlstream -c <config> topics delete` removes the old topics)"
            )
        if published < self.version:
            update = self._signed(ptr["update"])  # this start's writer epoch
            read_bytes_verified(update["uri"], update["sha256"])
            publish_weight_update(self.producer, self.cfg.topics.name("control"), update, self.liveness.outage_s)
            log.info("re-published weight update after restart %s", kv(version=update["version"]))

    def _signed(self, update: dict) -> dict:
        return self.signer.sign(update) if self.signer is not None else update

    def _ingest(self, msgs) -> None:
        now = time.monotonic()
        for m in msgs:
            p, o = m.partition(), m.offset()
            if self.offsets.seen(p, o):
                self.metrics.inc("resume_skipped")
                continue
            try:
                rec = decode_message(m, "ScoredTrajectory")
                sample = sample_from_record(rec, p, o, self._vocab, self._max_len, self._token_rule)
            except DecodeError as exc:
                self._dead_letter(m, exc)
                self.offsets.dispose(p, o)
                continue
            status = self.assembler.add(sample, now)
            self.metrics.inc("records_read")
            if status == "tail":
                self.metrics.inc("tail_samples_read")
            if status in ("late", "duplicate"):
                self.offsets.dispose(p, o)
                self.metrics.inc(f"{status}_dropped")
                log.warning(
                    "refused sample %s", kv(reason=status, trajectory=sample.trajectory_id, partition=p, offset=o)
                )

    def _dead_letter(self, msg, exc: DecodeError) -> None:
        rec = self.dead_letter(msg, exc.error_type, str(exc))
        self.producer.produce_record(self.cfg.topics.name("dlq"), "DeadLetter", rec, key=msg.key())
        self.metrics.inc("dead_letters")
        self.metrics.inc(f"dead_letters.{exc.error_type}")
        log.error("dead-lettered record %s", kv(partition=msg.partition(), offset=msg.offset(), reason=exc))

    @property
    def _token_rule(self) -> bool:
        return self.cfg.rl.staleness_rule == "token"

    def _select(self):
        """The step's groups from the selector (None: wait); groups dynamic sampling set aside now
        join ``_filtered`` (they go with the next step)."""
        tc, keep = self.tc, None
        if tc.dynamic_sampling:
            args = (self.version, self.k, tc.incomplete_groups, tc.dynamic_sampling_tol, self.cfg.rl.staleness_rule)
            keep = lambda g: informative(g, *args)  # noqa: E731
        filtered, groups = self.selector.select(self.assembler, self.version, self._at_end, self.step, keep)
        if filtered:
            self._filtered.extend(filtered)
            self._filtered_since_pub += len(filtered)
            log.debug("filtered groups %s", kv(groups=[g.id for g in filtered], version=self.version))
        if groups is not None:
            self._tails = self.selector.take_tails(self.assembler, self.step)
        return groups

    def _caught_up(self) -> bool:
        """True if every partition of rl.scored has been read to its end offset (the last stable
        offset: this consumer reads committed records only)."""
        timeout = self.cfg.kafka.request_timeout_s
        pos = self.consumer.position([(self.topic, p) for p in self._parts])
        for p in self._parts:
            at = pos.get((self.topic, p), -1)
            low, high = self.consumer.watermarks(self.topic, p, timeout)
            if high > (at if at >= 0 else max(low, self._starts.get(p, low))):
                return False
        return True

    def _publish_progress(self) -> None:
        """While waiting for groups: tell producers how many groups this trainer has consumed
        (filtered ones included), so admission keeps supplying (pipeline.control)."""
        pub_version, pub_consumed = self._published
        progress = pub_consumed + self._filtered_since_pub
        if progress > self._progress_sent:
            publish_progress(
                self.producer, self.cfg.topics.name("control"), pub_version, progress, self.tc.trainer_id,
                self.liveness.outage_s, self.signer.sign if self.signer is not None else None,
            )  # fmt: skip
            self._progress_sent = progress
            self.metrics.set("admission_consumed_groups", progress)

    def _next(self):
        """Rank 0: ("step", samples), ("idle", None) or ("stop", None)."""
        if self.stop_event.is_set():
            return "stop", None
        groups = self._select()
        if groups is None:
            first = self.consumer.poll(self.tc.poll_timeout_s)
            msgs = ([first] if first is not None else []) + self.consumer.consume(5000, 0)
            self._ingest(msgs)
            for g in self.assembler.expire(time.monotonic()):
                log.warning("closed incomplete group %s", kv(group=g.id, have=len(g.samples), want=g.size))
            self.metrics.set("open_groups", len(self.assembler.open))
            self.metrics.set("ready_groups", len(self.assembler.ready))
            if self.selector.needs_end:
                self._at_end = not msgs and self._caught_up()
            groups = self._select()
            if groups is None:
                self._publish_progress()
                self.metrics.maybe_publish()
                return "idle", None
        tc = self.tc
        self.step_beat.begin(self.step + 1)
        plan = plan_step(
            groups,
            self.version,
            self.k,
            tc.incomplete_groups,
            tc.advantage,
            tc.overlong_filter,
            self.cfg.rl.staleness_rule,
            self._tails,
        )
        self._current = (groups, plan, self._filtered, self._tails)
        self._filtered, self._tails = [], []
        return "step", plan.train

    # ---- the loop (every rank) -------------------------------------------------------------
    def run_once(self) -> bool:
        """One trainer step or idle poll. SIGTERM/SIGINT: rank 0 stops after the current step and
        broadcasts the stop; other ranks (a launcher signals them all) keep going until that
        broadcast, so no collective is left half-done."""
        if self.max_steps and self.step >= self.max_steps:
            return False
        cmd, payload = self._next() if self.rank == 0 else (None, None)
        cmd, payload = broadcast_object((cmd, payload), self.world)
        if cmd == "step":
            self._do_step(payload)
        return cmd != "stop"

    def finish(self) -> None:
        """Stopped between checkpoints: keep what was trained (a collective, so every rank decides)."""
        if broadcast_object(bool(self._pending_log) if self.rank == 0 else None, self.world):
            self._checkpoint()

    def result(self) -> int:
        return self.step

    def teardown_hazards(self) -> dict:
        """Also a multi-rank run: a gloo worker thread that drops its last tensor while the
        interpreter finalizes aborts the process (SIGABRT, "terminate called without an active
        exception"; seen in ~1 of 25 finished launches) and torchrun calls the run failed."""
        return {**super().teardown_hazards(), **({"world": self.world} if self.world > 1 else {})}

    def _do_step(self, samples) -> None:
        t0 = time.monotonic()
        with self.section("train step"):
            result = self._train(samples)
        self.step += 1
        self.version += 1
        if self.rank == 0:
            self._account(result, time.monotonic() - t0)
        if self.step % self.tc.publish_every == 0 or (self.max_steps and self.step >= self.max_steps):
            self._phase("checkpoint")
            with self.section("checkpoint"):
                self._checkpoint()
        if self.step_beat is not None:
            self.step_beat.end()

    def _phase(self, name: str) -> None:
        if self.step_beat is not None:
            self.step_beat.phase(name)

    def _train(self, samples) -> dict:
        return train_samples(self.engine, samples, self.tc, self.loss_fn, self.step, self.ref, progress=self.step_beat)

    def _account(self, result: dict, step_s: float) -> None:
        """Rank 0: dispose the step's records, count, log, report (``accounting.account_step``)."""
        groups, plan, filtered, tails = self._current
        for s in [*(s for g in [*groups, *filtered] for s in g.samples), *(t.sample for t in tails)]:
            self.offsets.dispose(s.partition, s.offset)
        self.consumed += len(groups) + len(filtered)
        entry = account_step(
            self.metrics, self.step, self.version, plan, groups, filtered, result, step_s, self.consumed,
            self._token_rule,
        )  # fmt: skip
        self._pending_log.append(entry)

    # ---- checkpoint + publish (every rank) ------------------------------------------------
    def _checkpoint(self) -> None:
        sd = self.engine.state_dict()
        tag = broadcast_object(self.ckpts.new_tag(self.step) if self.rank == 0 else None, self.world)
        update = None
        if self.rank == 0:
            t0 = time.monotonic()
            update = write_version(
                self.engine, sd, self.cfg.store, self.version, self.step, self.tc, self.consumed, self._base_sha,
                write_full=write_weights,  # looked up here, so rlstream.dev.bench.trainer_steps can time it
                guard=self.ckpts.guard,
            )  # fmt: skip
            update = self._signed(update)
            self.metrics.set("weights_write_ms", (time.monotonic() - t0) * 1e3)
        del sd
        t1 = time.monotonic()
        self.ckpts.save_engine(self.engine, tag)
        barrier(self.world)
        if self.rank != 0:
            return
        self.ckpts.append_steps(self._pending_log)
        self._pending_log = []
        snapshot = self.offsets.snapshot()
        record = {
            "version": self.version,
            "step": self.step,
            "tag": tag,
            "topic": self.topic,
            "offsets": snapshot,
            "trained_groups": self.assembler.trained_ids(),
            "group_heads": self.assembler.heads_state(),
            "update": update,
            "consumed_groups": self.consumed,
            "counters": dict(self.metrics.counters),
            "written_at_ms": now_ms(),
            "files": self.ckpts.digests(tag),
        }
        self._records = [*self._records, record][-self.tc.keep_checkpoints :]
        self.ckpts.write_pointer({**record, "previous": self._records[:-1]})
        t2 = time.monotonic()
        self._phase("publishing weights")
        publish_weight_update(self.producer, self.cfg.topics.name("control"), update, self.liveness.outage_s)
        t3 = time.monotonic()
        self._published = (self.version, self.consumed)
        self._filtered_since_pub = len(self._filtered)
        self._progress_sent = self.consumed
        self._commit_offsets(snapshot)
        try:  # clean-up only: what is not removed now is removed after a later step
            self.ckpts.gc([r["tag"] for r in self._records])
            gc_versions(self.cfg.store, self.tc.keep_weight_versions)
        except OSError as exc:
            log.warning("could not remove old versions; trying again after the next step %s", kv(error=exc))
        self.metrics.set("trainer_ckpt_ms", (t2 - t1) * 1e3)
        self.metrics.set("publish_ms", (t3 - t2) * 1e3)
        self.metrics.observe("publish_latency_ms", (t3 - t2) * 1e3)

    def _commit_offsets(self, snapshot: dict) -> None:
        """Commit the floors to the consumer group, asynchronously: lag visibility only (resume never
        reads them), so a step does not wait for the group coordinator's round trip."""
        tps = [TopicPartition(self.topic, int(p), st["floor"]) for p, st in snapshot.items()]
        if tps:
            try:
                self.consumer.commit(tps, asynchronous=True)
            except KafkaClientError as exc:  # lag display only
                log.warning("offset commit failed (lag display only) %s", kv(error=exc))
            self._last_commit = tps

    @staticmethod
    def _on_commit(err, partitions) -> None:
        if err is not None:  # fault tolerance intended: the checkpoint holds the truth
            log.warning("offset commit failed (lag display only) %s", kv(error=err))

    def close(self) -> None:
        """Rank 0: final metrics and offset commit, close the clients, free the checkpoint dir. Every
        rank, after a clean stop (no collective is left): destroy the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.rank == 0:
                self._close_clients()
        finally:
            if not self.failed:
                close_dist(self.world)

    def _close_clients(self) -> None:
        try:
            if self.metrics is not None and not self.failed:
                self.metrics.publish()
            if self._last_commit and not self.failed:  # the last floors, before leaving
                try:
                    self.consumer.commit(self._last_commit)
                except KafkaClientError as exc:  # lag display only
                    log.warning("final offset commit failed %s", kv(error=exc))
        finally:
            try:
                if self.step_beat is not None:
                    self.step_beat.close()
                if self.metrics is not None:
                    self.metrics.close()
                if self.consumer is not None:
                    self.consumer.close()
            finally:
                try:
                    if self.producer is not None:
                        self.producer.close()
                finally:
                    self.ckpts.unlock(self._lock)
                    self._lock = None


PACKING_ATTENTION = frozenset({"sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"})


def check_packing(model_config) -> None:
    """ConfigError unless the model's attention implementation honours packed ``position_ids``."""
    impl = getattr(model_config, "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        raise ConfigError(
            f"trainer.packing needs an attention implementation that separates packed sequences by their "
            f"position_ids ({sorted(PACKING_ATTENTION)}); this model uses {impl!r}"
        )


def run(cfg, max_steps: int | None = None, stop=None) -> int:
    """Run the trainer (``rlstream train``). Returns the step reached."""
    return Trainer(cfg, max_steps=max_steps).run(stop)
