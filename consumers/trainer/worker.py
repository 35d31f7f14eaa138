"""The trainer consumer: reads rl.scored (read_committed), assembles GRPO groups, trains one step
per G closed groups, writes versioned weights and announces them on rl.control.

Per trainer step (version ``v`` -> ``v + 1``):
  1. take the next G closed groups (complete, or incomplete past ``group_timeout_s``); with
     ``dynamic_sampling`` groups whose rewards have zero variance are filtered first (they do not
     count towards G; they are counted, logged with the step, and reported to the producers as
     consumed: ``groups_consumed`` progress records and ``WeightUpdate.consumed_groups``);
  2. ``batch.plan_step``: drop samples with ``v - version_min > k`` (counted as ``stale_dropped``),
     apply the incomplete-group policy, compute advantages, mask truncated samples
     (``overlong_filter``);
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
from pathlib import Path

from consumers.trainer.assembler import GroupAssembler, OffsetTracker
from consumers.trainer.batch import informative, plan_step, sample_from_record
from consumers.trainer.engines import TrainContext, build_engine
from consumers.trainer.engines.base import barrier, broadcast_object, dist_env
from consumers.trainer.losses import LossFn
from consumers.trainer.publish import write_version
from consumers.trainer.state import TrainerCheckpoints
from consumers.trainer.step import train_samples
from pipeline.checkpoint import gc_versions, model_fingerprint, read_bytes_verified, write_weights
from pipeline.control import ControlFollower, now_ms, publish_progress, publish_weight_update
from pipeline.errors import ConfigError, DecodeError, KafkaClientError, RlstreamError
from pipeline.kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition, client_conf, decode_message
from pipeline.log import kv
from pipeline.metrics import WorkerMetrics
from pipeline.models import load_model, materialize
from pipeline.worker import Worker

log = logging.getLogger(__name__)


class Trainer(Worker):
    role = "trainer"
    unit = "step"
    stops_itself = True  # rank 0 decides and broadcasts the stop, so no collective is left half-done

    def __init__(self, cfg, max_steps: int | None = None):
        super().__init__(cfg, cfg.trainer.trainer_id)
        tc = self.tc = cfg.trainer
        self.k, self.G = cfg.rl.max_staleness, cfg.rl.groups_per_step
        self.max_steps = tc.max_steps if max_steps is None else max_steps
        if tc.publish_every > self.k + 1:
            raise ConfigError(
                f"trainer.publish_every={tc.publish_every} needs rl.max_staleness >= {tc.publish_every - 1}: "
                "producers admit groups by the published version, so a larger interval would deadlock"
            )
        self.rank, self.world, _ = dist_env()
        self.root = Path(tc.checkpoint_dir or Path(cfg.run_dir) / "trainer")
        self.ckpts = TrainerCheckpoints(self.root)
        self._lock = None
        self.producer = self.consumer = self.metrics = None
        self.step = self.version = 0
        self._closed = False

    def setup(self) -> None:
        cfg, tc = self.cfg, self.tc
        if self.rank == 0:
            self._lock = self.ckpts.lock()  # one trainer per dir; the OS frees it on kill -9
            self.write_resolved("trainer")
        model_dir = materialize(cfg.model)
        self.engine = build_engine(tc.engine, TrainContext(model_dir, tc))
        self.rank, self.world = self.engine.rank, self.engine.world_size
        mcfg = getattr(self.engine, "config", None)  # what only the trainer can check: ids and lengths
        self._vocab = getattr(mcfg, "vocab_size", None)
        self._max_len = getattr(mcfg, "max_position_embeddings", None)
        if tc.packing:
            check_packing(mcfg)
        self.ref = None
        if tc.loss.kl_coef > 0:
            self.ref = load_model(model_dir, device=str(self.engine.device)).eval().requires_grad_(False)
        self.loss_fn = LossFn(tc.loss)
        self.version = self.step = 0
        self._pending_log: list[dict] = []
        self._base_sha = (
            model_fingerprint(model_dir) if self.engine.weights_kind == "adapter" and self.rank == 0 else ""
        )
        ptr = self.ckpts.read_pointer()
        self._tags = [ptr["tag"]] if ptr else []
        if ptr:
            self.engine.load(self.ckpts.tag_dir(ptr["tag"]))
            self.version, self.step = int(ptr["version"]), int(ptr["step"])
        # admission accounting (pipeline.control): groups consumed by committed steps, and the
        # published version's count plus the groups filtered since (what producers admit from)
        self.consumed = int(ptr.get("consumed_groups", self.version * self.G)) if ptr else 0
        self._published = (self.version, self.consumed)
        self._filtered: list = []  # groups filtered by dynamic sampling, waiting for the next step
        self._filtered_since_pub = 0
        self._progress_sent = self.consumed
        log.info("trainer state %s", kv(rank=self.rank, version=self.version, step=self.step, resumed=bool(ptr)))
        if self.rank == 0:
            cut = self.ckpts.truncate_steps(self.step)
            if cut:
                log.info("cut steps-log lines of lost work %s", kv(lines=cut, after_step=self.step))
            self._setup_kafka(ptr)

    # ---- Kafka (rank 0) --------------------------------------------------------------------
    def _setup_kafka(self, ptr: dict | None) -> None:
        cfg, tc, wid = self.cfg, self.tc, self.tc.trainer_id
        self.topic = cfg.topics.name("scored")
        self.offsets = OffsetTracker(ptr["offsets"] if ptr else None)
        self.assembler = GroupAssembler(
            tc.group_timeout_s, tc.closed_group_memory, ptr["trained_groups"] if ptr else []
        )
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
        log.info("consuming %s", kv(topic=self.topic, partitions=len(parts), start={p: starts.get(p) for p in parts}))
        self._reconcile_control(ptr)

    def _reconcile_control(self, ptr: dict | None) -> None:
        """Make rl.control agree with the checkpoint: re-publish its notice if a crash came before it."""
        follower = ControlFollower(self.cfg, "trainer", self.tc.trainer_id)
        try:
            latest = follower.catch_up(self.liveness.startup_timeout_s)
        finally:
            follower.close()
        published = latest["version"] if latest else 0
        if published > self.version:
            raise RlstreamError(
                f"{self.cfg.topics.name('control')} already announces version {published} but this trainer's checkpoint "
                f"({self.root}) is at version {self.version}; refusing to announce different weights under the same "
                "version (restore the checkpoint dir or use a fresh topics.prefix)"
            )
        if published < self.version:
            update = ptr["update"]
            read_bytes_verified(update["uri"], update["sha256"])
            publish_weight_update(self.producer, self.cfg.topics.name("control"), update, self.liveness.outage_s)
            log.info("re-published weight update after restart %s", kv(version=update["version"]))

    def _ingest(self, msgs) -> None:
        now = time.monotonic()
        for m in msgs:
            p, o = m.partition(), m.offset()
            if self.offsets.seen(p, o):
                self.metrics.inc("resume_skipped")
                continue
            try:
                rec = decode_message(m, "ScoredTrajectory")
                sample = sample_from_record(rec, p, o, self._vocab, self._max_len)
            except DecodeError as exc:
                self._dead_letter(m, exc)
                self.offsets.dispose(p, o)
                continue
            status = self.assembler.add(sample, now)
            self.metrics.inc("records_read")
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

    def _filter(self) -> None:
        """Dynamic sampling: set aside closed groups whose rewards have zero variance."""
        if not self.tc.dynamic_sampling:
            return
        tc = self.tc
        out = self.assembler.filter_ready(
            lambda g: informative(g, self.version, self.k, tc.incomplete_groups, tc.dynamic_sampling_tol)
        )
        if out:
            self._filtered.extend(out)
            self._filtered_since_pub += len(out)
            log.debug("filtered groups %s", kv(groups=[g.group_id for g in out], version=self.version))

    def _publish_progress(self) -> None:
        """While waiting for groups: tell producers how many groups this trainer has consumed
        (filtered ones included), so admission keeps supplying (pipeline.control)."""
        pub_version, pub_consumed = self._published
        progress = pub_consumed + self._filtered_since_pub
        if progress > self._progress_sent:
            publish_progress(
                self.producer, self.cfg.topics.name("control"), pub_version, progress, self.tc.trainer_id,
                self.liveness.outage_s,
            )  # fmt: skip
            self._progress_sent = progress
            self.metrics.set("admission_consumed_groups", progress)

    def _next(self):
        """Rank 0: ("step", samples), ("idle", None) or ("stop", None)."""
        if self.stop_event.is_set():
            return "stop", None
        self._filter()
        groups = self.assembler.take(self.G)
        if groups is None:
            first = self.consumer.poll(self.tc.poll_timeout_s)
            msgs = ([first] if first is not None else []) + self.consumer.consume(5000, 0)
            self._ingest(msgs)
            for g in self.assembler.expire(time.monotonic()):
                log.warning("closed incomplete group %s", kv(group=g.group_id, have=len(g.samples), want=g.size))
            self.metrics.set("open_groups", len(self.assembler.open))
            self.metrics.set("ready_groups", len(self.assembler.ready))
            self._filter()
            groups = self.assembler.take(self.G)
            if groups is None:
                self._publish_progress()
                self.metrics.maybe_publish()
                return "idle", None
        tc = self.tc
        plan = plan_step(groups, self.version, self.k, tc.incomplete_groups, tc.advantage, tc.overlong_filter)
        self._current = (groups, plan, self._filtered)
        self._filtered = []
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

    def _do_step(self, samples) -> None:
        t0 = time.monotonic()
        with self.section("train step"):
            result = self._train(samples)
        self.step += 1
        self.version += 1
        if self.rank == 0:
            self._account(result, time.monotonic() - t0)
        if self.step % self.tc.publish_every == 0 or (self.max_steps and self.step >= self.max_steps):
            with self.section("checkpoint"):
                self._checkpoint()

    def _train(self, samples) -> dict:
        return train_samples(self.engine, samples, self.tc, self.loss_fn, self.step, self.ref)

    def _account(self, result: dict, step_s: float) -> None:
        """Rank 0: dispose the step's records, count, log, report."""
        groups, plan, filtered = self._current
        for g in [*groups, *filtered]:
            for s in g.samples:
                self.offsets.dispose(s.partition, s.offset)
        self.consumed += len(groups) + len(filtered)
        skipped = set(result["skipped_ids"])  # in an update that was skipped: not used
        used = [s for s in plan.train if s.trajectory_id not in skipped]
        m = self.metrics
        m.inc("steps")
        m.inc("optimizer_steps", result["optimizer_steps"])
        m.inc("updates_skipped", result["skipped"])
        m.inc("groups_closed", len(groups))
        m.inc("groups_incomplete", plan.incomplete_groups)
        m.inc("samples_trained", len(used))
        m.inc("samples_update_skipped", len(skipped))
        m.inc("stale_dropped", len(plan.stale))
        m.inc("incomplete_dropped", len(plan.incomplete_dropped))
        m.inc("groups_filtered", len(filtered))
        m.inc("samples_filtered", sum(len(g.samples) for g in filtered))
        m.inc("overlong_masked", len(plan.overlong))
        lags = plan.version_lag_counts()
        for name in [n for n in m.gauges if n.startswith("version_lag_")]:
            del m.gauges[name]
        rewards = [s.reward for s in plan.train]
        sampled = [s.reward for s in [*plan.train, *plan.overlong]] + [s.reward for g in filtered for s in g.samples]
        gauges = {
            "step": self.step,
            "loss": result["loss"],
            "grad_norm": result["grad_norm"],
            "lr": result["lr"],
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward_mean_sampled": sum(sampled) / len(sampled) if sampled else 0.0,
            "consumed_groups": self.consumed,
            "step_time_s": step_s,
            "samples_per_s": len(plan.train) / step_s if step_s > 0 else 0.0,
            **{f"loss_{k}": v for k, v in result["stats"].items()},
            **{f"version_lag_{d}": n for d, n in lags.items()},
        }
        for name, value in gauges.items():
            m.set(name, value)
        m.version = self.version
        self._pending_log.append(
            {
                "step": self.step,
                "version": plan.version,
                "time": time.time(),
                "used": [s.trajectory_id for s in used],
                "update_skipped": sorted(skipped),
                "stale": [s.trajectory_id for s in plan.stale],
                "incomplete_dropped": [s.trajectory_id for s in plan.incomplete_dropped],
                "groups": [g.group_id for g in groups],
                "filtered": [s.trajectory_id for g in filtered for s in g.samples],
                "filtered_groups": [g.group_id for g in filtered],
                "overlong": [s.trajectory_id for s in plan.overlong],
                "consumed_groups": self.consumed,
                "staleness": {str(d): n for d, n in lags.items()},
                **{
                    k: gauges[k]
                    for k in (
                        "loss",
                        "grad_norm",
                        "lr",
                        "reward_mean",
                        "reward_mean_sampled",
                        "samples_per_s",
                        "step_time_s",
                    )
                },
            }
        )
        log.info(
            "step %s",
            kv(
                step=self.step,
                version=self.version,
                samples=len(used),
                update_skipped=len(skipped),
                stale=len(plan.stale),
                incomplete_dropped=len(plan.incomplete_dropped),
                filtered_groups=len(filtered),
                loss=round(result["loss"], 5),
                grad_norm=round(result["grad_norm"], 4),
                reward=round(gauges["reward_mean"], 3),
                s=round(step_s, 3),
            ),
        )
        m.publish()

    # ---- checkpoint + publish (every rank) ------------------------------------------------
    def _checkpoint(self) -> None:
        sd = self.engine.state_dict()
        tag = broadcast_object(self.ckpts.new_tag(self.step) if self.rank == 0 else None, self.world)
        update = None
        if self.rank == 0:
            t0 = time.monotonic()
            update = write_version(
                self.engine, sd, self.cfg.store, self.version, self.step, self.tc, self.consumed, self._base_sha,
                write_full=write_weights,  # looked up here, so rlstream.bench.trainer_steps can time it
            )  # fmt: skip
            self.metrics.set("weights_write_ms", (time.monotonic() - t0) * 1e3)
        del sd
        t1 = time.monotonic()
        self.engine.save(self.ckpts.tag_dir(tag))
        barrier(self.world)
        if self.rank != 0:
            return
        self.ckpts.append_steps(self._pending_log)
        self._pending_log = []
        snapshot = self.offsets.snapshot()
        self.ckpts.write_pointer(
            {
                "version": self.version,
                "step": self.step,
                "tag": tag,
                "topic": self.topic,
                "offsets": snapshot,
                "trained_groups": self.assembler.trained_ids(),
                "update": update,
                "consumed_groups": self.consumed,
                "counters": dict(self.metrics.counters),
                "written_at_ms": now_ms(),
            }
        )
        t2 = time.monotonic()
        publish_weight_update(self.producer, self.cfg.topics.name("control"), update, self.liveness.outage_s)
        t3 = time.monotonic()
        self._published = (self.version, self.consumed)
        self._filtered_since_pub = len(self._filtered)
        self._progress_sent = self.consumed
        self._commit_offsets(snapshot)
        self._tags = [*self._tags, tag][-self.tc.keep_checkpoints :]
        self.ckpts.gc(self._tags)
        gc_versions(self.cfg.store, self.tc.keep_weight_versions)
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
        """Rank 0: final metrics and offset commit, close the clients, free the checkpoint dir.
        Idempotent."""
        if self._closed or self.rank != 0:
            return
        self._closed = True
        try:
            if self.metrics is not None and not self.failed:
                self.metrics.publish()
            if getattr(self, "_last_commit", None) and not self.failed:  # the last floors, before leaving
                try:
                    self.consumer.commit(self._last_commit)
                except KafkaClientError as exc:  # lag display only
                    log.warning("final offset commit failed %s", kv(error=exc))
        finally:
            try:
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
