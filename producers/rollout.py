"""The rollout worker: a member of the rollout consumer group on rl.prompts that generates every
sample it is given with its engine and publishes each one to rl.rollouts, keyed by group id.

Queue scheduling: each sample is its own engine request. The worker keeps at most
``max_inflight`` samples in flight (in the engine or waiting on an environment step); as soon as
one finishes it is produced and the next sample is started. It consumes prompts only while it has
room (partitions are paused otherwise, so the group's other workers get them).

Commit protocol (``producers.ledger``): a prompt offset is committed only after every trajectory
of that message (or its dead letter) has been acknowledged by the broker, in offset order per
partition. On a cooperative rebalance the worker finishes the admitted messages of the revoked
partitions, flushes and commits them before giving them up; held (unadmitted) ones are left to
the next owner. A crash (kill -9) loses nothing: uncommitted prompts are generated again by the
next owner, so rl.rollouts is at-least-once and ``trajectory_id`` is the deduplication key.

Admission (``pipeline.control.may_admit``): a group starts only if ``group_seq < (v + k + 1) * G``
at the loaded version v; otherwise its message is held and its partition paused until a newer
WeightUpdate is loaded. Weight reload: rl.control is followed; a new checkpoint is fetched and
verified (sha256) in a background thread, then loaded at a safe point: ``drain`` stops starting
turns until the engine is empty, ``interrupt`` aborts in-flight requests and resumes them under
the new weights. Loaded version and latencies go to rl.metrics.

What this is not: a reward or training component, nor an engine (``producers.engines``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from confluent_kafka import TopicPartition

from pipeline.control import ControlFollower, may_admit, now_ms
from pipeline.errors import ConsumeError, DecodeError
from pipeline.kafka import Consumer, Producer, client_conf, decode_message
from pipeline.log import kv
from pipeline.metrics import WorkerMetrics
from producers.engines.base import GenOutput, GenRequest, build_engine
from producers.envs import env_factory
from producers.ledger import OffsetLedger
from producers.sample import Sample

log = logging.getLogger(__name__)


class BadPrompt(Exception):
    def __init__(self, error_type: str, reason: str):
        super().__init__(reason)
        self.error_type, self.reason = error_type, reason


class RolloutWorker:
    def __init__(self, cfg, engine=None, tokenizer=None):
        from pipeline.models import load_tokenizer, materialize

        self.cfg, self.rc = cfg, cfg.rollout
        self.worker_id = self.rc.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.k, self.G = cfg.rl.max_staleness, cfg.rl.groups_per_step
        model_dir = materialize(cfg.model)
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        self.engine = engine or build_engine(self.rc.engine, model_dir, self.tokenizer, self.worker_id)
        self.max_len = int(getattr(self.engine, "max_model_len", 1 << 30))
        self.stop_ids = frozenset(self._stop_id(s) for s in self.rc.env.stop)
        self.envs = {task: env_factory(spec) for task, spec in self.rc.env.tasks.items()}
        self.topics = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "dlq", "metrics")}
        self.producer = Producer(client_conf(cfg, "rollout", self.worker_id, kind="producer"))
        self.consumer = Consumer(
            client_conf(cfg, "rollout", self.worker_id, kind="consumer"), group_id=self.rc.group_id
        )
        self.control = ControlFollower(cfg, "rollout", self.worker_id)
        self.metrics = WorkerMetrics(
            "rollout", self.worker_id, self.producer, self.topics["metrics"], self.rc.metrics_interval_s,
            self.rc.prometheus_port, labels={"engine": self.engine.name},
        )  # fmt: skip
        self.metrics.version = self.engine.version
        self.ledger = OffsetLedger()
        self.ready: deque[Sample] = deque()  # admitted, not started
        self.running: dict[str, tuple[Sample, GenRequest]] = {}  # engine request id -> (sample, request)
        self.env_pool = ThreadPoolExecutor(self.rc.env.workers, thread_name_prefix="env-step")
        self.env_steps: dict[Future, Sample] = {}
        self.held: dict[tuple[str, int], deque] = {}  # partition -> messages waiting for admission
        self.paused: set[tuple[str, int]] = set()
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self.fetch: tuple[dict, Future, float] | None = None  # update being fetched and verified
        self.loadable: tuple[dict, object, float] | None = None  # verified, waiting for a safe point
        self.stats = {"trajectories": 0, "dlq": 0, "admitted_groups": 0, "loads": 0}
        self._last_work = time.monotonic()
        self._last_commit = 0.0
        self.to_commit: dict[tuple[str, int], int] = {}
        self._commit_failures = 0

    def _stop_id(self, s: str) -> int:
        ids = self.tokenizer.encode(s, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"rollout.env.stop {s!r} must be exactly one token, it is {ids}")
        return ids[0]

    # -- main loop -------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> dict:
        stop = stop or threading.Event()
        self.consumer.subscribe([self.topics["prompts"]], on_revoke=self._on_revoke, on_lost=self._on_lost)
        update = self.control.catch_up(self.cfg.kafka.request_timeout_s)
        if update is not None and update["version"] > self.engine.version:
            self._start_fetch(update)
            self._wait_loadable()
            self._load()
        log.info(
            "rollout worker started %s", kv(worker=self.worker_id, engine=self.engine.name, version=self.engine.version)
        )
        try:
            while not stop.is_set():
                self._work_once(consume=True)
                idle = self.rc.exit_when_idle_s
                if idle and not self._busy() and time.monotonic() - self._last_work > idle:
                    log.info("idle for %.1fs, stopping", idle)
                    break
            self._drain(lambda tp: True)
            self._commit(force=True)
        finally:
            self.close()
        return self.stats

    def _busy(self) -> bool:
        return bool(self.ready or self.running or self.env_steps or self.ledger.outstanding() or self.held)

    def _work_once(self, consume: bool) -> None:
        self._poll_control()
        self._maybe_load()
        self._start_samples()
        if self.running:
            self._handle_outputs(self.engine.step(0.01 if self.engine.name == "openai" else 0.0))
        self._finish_env_steps()
        if consume:
            self._poll_prompts()
        elif not self.running:
            time.sleep(0.005)
        self.producer.poll(0)
        self._commit()
        self.metrics.set("inflight", len(self.running) + len(self.env_steps))
        self.metrics.set("ready", len(self.ready))
        self.metrics.set("held_messages", sum(len(q) for q in self.held.values()))
        self.metrics.maybe_publish()

    # -- prompts ---------------------------------------------------------------------------------
    def _capacity(self) -> int:
        return self.rc.max_inflight - len(self.running) - len(self.env_steps) - len(self.ready)

    def _poll_prompts(self) -> None:
        cap = self._capacity()
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.client.assignment()}
        want_paused = (assigned if cap <= 0 else set()) | {tp for tp, q in self.held.items() if q}
        want_paused &= assigned
        if want_paused - self.paused:
            self.consumer.client.pause([_tp(t) for t in want_paused - self.paused])
        if (self.paused - want_paused) & assigned:
            self.consumer.client.resume([_tp(t) for t in (self.paused - want_paused) & assigned])
        self.paused = want_paused
        idle = not (self.running or self.env_steps or self.ready)
        msgs = self.consumer.consume(max(1, min(cap, 100)), self.rc.poll_timeout_s if idle else 0.0)
        if msgs:
            assigned = {(tp.topic, tp.partition) for tp in self.consumer.client.assignment()}
        for msg in msgs:
            self._last_work = time.monotonic()
            if (msg.topic(), msg.partition()) in assigned:  # not one revoked during this consume
                self._on_message(msg)

    def _on_message(self, msg) -> None:
        tp = (msg.topic(), msg.partition())
        try:
            prompt = self._parse(msg)
        except BadPrompt as exc:
            gen = self.ledger.add(tp, msg.offset(), 1)
            self._dead_letter(msg, exc.error_type, exc.reason, gen)
            return
        gen = self.ledger.add(tp, msg.offset(), prompt["sample_count"])
        q = self.held.get(tp)
        if q or not self._admissible(prompt):
            self.held.setdefault(tp, deque()).append((msg.offset(), prompt, gen))
            self.metrics.inc("prompts_held")
            log.debug("holding %s", kv(group_seq=prompt["group_seq"], version=self.engine.version, k=self.k))
            return
        self._admit(tp, msg.offset(), prompt, gen)

    def _parse(self, msg) -> dict:
        try:
            prompt = decode_message(msg, "Prompt")
        except DecodeError as exc:
            raise BadPrompt(exc.error_type, str(exc)) from exc
        n, start, count = prompt["group_size"], prompt["sample_start"], prompt["sample_count"]
        if count < 1 or start < 0 or start + count > n:
            raise BadPrompt("invalid", f"samples [{start}, {start + count}) do not fit group_size {n}")
        toks = self.tokenizer(prompt["text"]).input_ids
        if len(toks) > self.rc.max_prompt_tokens or len(toks) >= self.max_len:
            limit = min(self.rc.max_prompt_tokens, self.max_len - 1)
            raise BadPrompt("too_long", f"prompt has {len(toks)} tokens, more than the limit {limit}")
        prompt["_tokens"] = toks
        return prompt

    def _admissible(self, prompt: dict) -> bool:
        return prompt["group_seq"] < 0 or may_admit(prompt["group_seq"], self.engine.version, self.k, self.G)

    def _admit(self, tp, offset: int, prompt: dict, gen: int) -> None:
        toks = prompt["_tokens"]
        budget = min(prompt["max_new_tokens"] or self.rc.max_new_tokens, self.max_len - len(toks))
        env_cls = self.envs.get(prompt["task"])
        for i in range(prompt["sample_start"], prompt["sample_start"] + prompt["sample_count"]):
            s = Sample(prompt, i, toks, budget, tp, offset, gen=gen)
            if env_cls is not None:
                s.env, s.max_turns, s.max_turn_tokens = env_cls(), self.rc.env.max_turns, self.rc.env.max_turn_tokens
            self.ready.append(s)
        self.stats["admitted_groups"] += 1
        self.metrics.inc("prompts_admitted")
        self.metrics.set("admitted_group_seq", prompt["group_seq"])
        self.metrics.set("admitted_at_version", self.engine.version)

    def _release_held(self) -> None:
        for tp, q in self.held.items():
            while q and self._admissible(q[0][1]):
                self._admit(tp, *q.popleft())

    def _dead_letter(self, msg, error_type: str, reason: str, gen: int) -> None:
        tp, off = (msg.topic(), msg.partition()), msg.offset()
        rec = {
            "source_topic": msg.topic(),
            "source_partition": msg.partition(),
            "source_offset": off,
            "key": msg.key(),
            "value": msg.value(),
            "headers": {k: (v or b"") for k, v in (msg.headers() or [])},
            "error_type": error_type,
            "reason": reason,
            "role": "rollout",
            "worker_id": self.worker_id,
            "failed_at_ms": now_ms(),
        }
        log.warning("dead letter %s", kv(partition=tp[1], offset=off, error_type=error_type, reason=reason))
        self.producer.produce_record(
            self.topics["dlq"], "DeadLetter", rec, key=msg.key(), on_delivery=self._acker(tp, off, gen)
        )
        self.stats["dlq"] += 1
        self.metrics.inc("dead_letters")

    def _acker(self, tp, offset: int, gen: int):
        def cb(err, _msg):
            if err is None:  # on error the Producer raises on the next produce/flush: no commit
                self.ledger.ack(tp, offset, gen)

        return cb

    # -- generation ------------------------------------------------------------------------------
    def _start_samples(self) -> None:
        if self.loadable is not None and self.rc.reload_policy == "drain":
            return  # drain: no new turn until the new weights are in
        while self.ready and len(self.running) + len(self.env_steps) < self.rc.max_inflight:
            s = self.ready.popleft()
            if s.start(self._tokenize, self.max_len):
                self._submit(s)
            else:
                self._publish(s)

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def _submit(self, s: Sample) -> None:
        req = s.request(self.rc.temperature, self.stop_ids, self.eos_id)
        self.running[req.rid] = (s, req)
        self.engine.submit(req)

    def _handle_outputs(self, outs) -> None:
        for out in outs:
            s, _ = self.running.pop(out.rid)
            s.add_output(out, self.engine.version)
            self.metrics.inc("tokens_generated", len(out.tokens))
            if s.end_turn(out, self.eos_id):
                self.env_steps[self.env_pool.submit(s.env.step, self.tokenizer.decode(out.tokens))] = s
            else:
                self._publish(s)

    def _finish_env_steps(self) -> None:
        for fut in [f for f in self.env_steps if f.done()]:
            s = self.env_steps.pop(fut)
            res = fut.result()  # an environment that raises stops the worker loudly
            obs = self.tokenizer(res.observation, add_special_tokens=False).input_ids
            if s.add_observation(res, obs) and (self.loadable is None or self.rc.reload_policy != "drain"):
                self._submit(s)
            elif s.finish is None:
                self.ready.appendleft(s)  # resumes after the weight load (started already)
            else:
                self._publish(s)

    def _publish(self, s: Sample) -> None:
        rec = s.trajectory(self.tokenizer, self.worker_id, self.engine.name, self.engine.version)
        self.producer.produce_record(
            self.topics["rollouts"],
            "Trajectory",
            rec,
            key=rec["group_id"].encode(),
            on_delivery=self._acker(s.tp, s.offset, s.gen),
        )
        self.stats["trajectories"] += 1
        self.metrics.inc("trajectories")
        self.metrics.observe("gen_latency_ms", rec["gen_finished_at_ms"] - rec["gen_started_at_ms"])
        self._last_work = time.monotonic()

    # -- weights ---------------------------------------------------------------------------------
    def _poll_control(self) -> None:
        self.control.poll(0)
        self.control.commands.clear()  # feed states and operator commands: not the worker's business
        upd = self.control.latest_update
        newest = max([self.engine.version] + [x[0]["version"] for x in (self.fetch, self.loadable) if x])
        if upd is not None and upd["version"] > newest and self.fetch is None and self.loadable is None:
            self._start_fetch(upd)
        if self.fetch is not None and self.fetch[1].done():
            upd, fut, t0 = self.fetch
            self.fetch = None
            prepared = fut.result()  # a bad checksum or unreadable checkpoint stops the worker loudly
            self.metrics.observe("weight_fetch_ms", (time.monotonic() - t0) * 1e3)
            self.loadable = (upd, prepared, t0)

    def _start_fetch(self, upd: dict) -> None:
        log.info("fetching weights %s", kv(version=upd["version"], uri=upd["uri"]))
        self.fetch = (upd, self.loader.submit(self.engine.prepare_weights, upd), time.monotonic())

    def _wait_loadable(self) -> None:
        while self.loadable is None:
            self._poll_control()
            time.sleep(0.01)

    def _maybe_load(self) -> None:
        if self.loadable is None:
            return
        if self.rc.reload_policy == "interrupt" and self.running:
            finished = []
            for out in self.engine.abort():
                s, req = self.running[out.rid]
                if out.tokens and (out.tokens[-1] in req.stop_ids or len(out.tokens) >= req.max_new_tokens):
                    # it had finished before the abort reached it: a normal end of turn
                    reason = "length" if out.tokens[-1] not in req.stop_ids else "stop"
                    finished.append(GenOutput(out.rid, out.tokens, out.logprobs, reason))
                    continue
                self.running.pop(out.rid)
                s.add_output(out, self.engine.version)
                self.ready.appendleft(s)  # resumed by the next _start_samples, under the new weights
                self.metrics.inc("interrupted")
            self._handle_outputs(finished)
        if self.running or self.engine.inflight():
            return  # drain: wait for the engine to empty
        self._load()
        self._release_held()

    def _load(self) -> None:
        upd, prepared, t0 = self.loadable
        t1 = time.monotonic()
        self.engine.load_weights(upd, prepared)
        self.loadable = None
        swap_ms, total_ms = (time.monotonic() - t1) * 1e3, (time.monotonic() - t0) * 1e3
        self.stats["loads"] += 1
        self.metrics.version = self.engine.version
        self.metrics.set("loaded_version", self.engine.version)
        self.metrics.set("weight_load_ms", total_ms)
        self.metrics.observe("weight_swap_ms", swap_ms)
        self.metrics.set("weight_update_lag_ms", now_ms() - upd["created_at_ms"])
        self.metrics.inc("weight_loads")
        self.metrics.publish()
        log.info(
            "loaded weights %s", kv(version=self.engine.version, load_ms=round(total_ms, 1), swap_ms=round(swap_ms, 1))
        )

    # -- commits and rebalances ------------------------------------------------------------------
    def _commit(self, force: bool = False, tps=None) -> None:
        if not force and time.monotonic() - self._last_commit < 0.2:
            return
        self._last_commit = time.monotonic()
        for o in self.ledger.committable(tps):
            self.to_commit[(o.topic, o.partition)] = o.offset
        todo = {tp: off for tp, off in self.to_commit.items() if tps is None or tp in tps}
        if not todo:
            return
        try:
            self.consumer.commit([TopicPartition(t, p, off) for (t, p), off in todo.items()])
        except ConsumeError as exc:  # e.g. REBALANCE_IN_PROGRESS: keep the offsets, retry soon
            self._commit_failures += 1
            self.metrics.inc("commit_errors")
            if self._commit_failures > 50:
                raise
            log.warning("commit failed, will retry %s", kv(error=exc))
            return
        self._commit_failures = 0
        for tp, off in todo.items():
            if self.to_commit.get(tp) == off:
                del self.to_commit[tp]
        log.debug("committed %s", kv(offsets=sorted((tp[1], off) for tp, off in todo.items())))

    def _drain(self, pred) -> None:
        """Finish every admitted sample of partitions matching ``pred``, wait for their acks, commit."""
        for tp in [tp for tp in self.held if pred(tp)]:
            self.held.pop(tp)

        def pending():
            running = [s for s, _ in self.running.values()]
            return any(pred(s.tp) for s in [*self.ready, *running, *self.env_steps.values()])

        while pending():
            self._work_once(consume=False)
        self.producer.flush(self.cfg.kafka.request_timeout_s)
        self._commit(force=True, tps={tp for tp in self.ledger.parts if pred(tp)})

    def _on_revoke(self, _consumer, partitions) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        log.info("partitions revoked, finishing their admitted prompts %s", kv(partitions=sorted(t[1] for t in tps)))
        self._drain(lambda tp: tp in tps)
        self.ledger.drop(tps)
        for tp in tps:
            self.to_commit.pop(tp, None)
        self.paused -= tps

    def _on_lost(self, _consumer, partitions) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        log.warning("partitions lost %s", kv(partitions=sorted(t[1] for t in tps)))
        self.ledger.drop(tps)
        for tp in tps:
            self.held.pop(tp, None)
            self.to_commit.pop(tp, None)
        self.paused -= tps

    def close(self) -> None:
        try:
            self.consumer.close()  # a final revoke: nothing left to drain
            self.producer.close(self.cfg.kafka.request_timeout_s)
        finally:
            self.control.close()
            self.env_pool.shutdown(wait=False, cancel_futures=True)
            self.loader.shutdown(wait=False, cancel_futures=True)
            self.metrics.close()
            self.engine.close()


def _tp(t) -> TopicPartition:
    return TopicPartition(t[0], t[1])


def run(cfg, stop: threading.Event | None = None) -> dict:
    """Run one rollout worker until ``stop`` is set, SIGTERM/SIGINT, or ``exit_when_idle_s``."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    worker = RolloutWorker(cfg)
    stats = worker.run(stop)
    log.info("rollout worker stopped %s", kv(**stats))
    print(json.dumps(stats), flush=True)
    return stats
