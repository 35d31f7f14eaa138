"""The rollout worker: a member of the rollout consumer group on rl.prompts that generates every
sample it is given with its engine and publishes each one to rl.rollouts, keyed by group id.

Queue scheduling: each sample is its own engine request. The worker keeps at most
``max_inflight`` samples in flight (in the engine or waiting on an environment step); as soon as
one finishes it is produced and the next sample is started. Consumed prompt messages wait in a
per-partition queue (``rollout.queue_samples``) and are admitted, oldest group first, as slots and
the look-ahead (``rollout.prefetch_samples``) free; a partition is paused only when its share of the
queue is full, since a pause drops librdkafka's fetched messages and a resume waits for a fetch.

Commit protocol (``producers.commits`` over ``producers.ledger``): a prompt offset is committed
only after every trajectory of that message (or its dead letter) is acknowledged, in offset order
per partition; a revoked partition's admitted messages are finished and committed before it goes.
A crash (kill -9) loses nothing: uncommitted prompts are generated again by the next owner, so
rl.rollouts is at-least-once and ``trajectory_id`` is the deduplication key.
A message and a copy of it (the same group fed twice, or a re-delivery while the first is still
generating) are both generated, each sample under its own engine request id; the trainer drops
the repeated trajectory ids.

Admission (``pipeline.control.may_admit``): a group starts only if ``group_seq < C(v) + (k + 1) * G``
at the loaded version v, where C(v) is the number of groups the trainer had consumed when it
published v (``v * G`` unless groups were filtered); otherwise its message stays queued, and so
do the ones behind it on its partition, until a newer WeightUpdate is loaded. Weight reload
(``producers.weights``): rl.control is followed; a new checkpoint is fetched and verified in a
background thread, then loaded at a safe point: ``drain`` stops starting turns until the engine
is empty, ``interrupt`` aborts in-flight requests and resumes them under the new weights.
Loaded version and latencies go to rl.metrics.

The process lifecycle (signals, watchdog, bounded shutdown) is ``pipeline.worker``'s.
What this is not: a reward or training component, nor an engine (``libs.engines``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque

from libs.chat import prompt_tokens
from libs.engines import EngineContext, GenOutput, build_engine
from pipeline.control import now_ms
from pipeline.errors import ConsumeError, DecodeError, DeliveryError
from pipeline.kafka import Consumer, Producer, client_conf, decode_message
from pipeline.log import kv
from pipeline.metrics import WorkerMetrics
from pipeline.records import InvalidRecord, check_prompt
from pipeline.worker import Worker
from producers.commits import PromptCommits
from producers.env_steps import EnvSteps
from producers.envs import EnvContext, env_factory
from producers.holding import GroupRace, SampleHold, StaleRestarts
from producers.prompt_queue import PromptQueue
from producers.sample import Sample
from producers.slots import RolloutSlots, spare_once
from producers.weights import WeightSync

log = logging.getLogger(__name__)
STOP_FLUSH_SHARE = 0.75
"""Share of ``liveness.shutdown_timeout_s`` a stop may spend finishing samples and waiting for acks."""
IDLE_SLICE_S = 0.01
"""An idle worker's prompt polls last this long; rl.control is followed between them."""


class RolloutWorker(Worker):
    role = "rollout"
    unit = "admitted samples"

    def __init__(self, cfg, engine=None, tokenizer=None):
        super().__init__(cfg, cfg.rollout.worker_id or None)
        self.rc = cfg.rollout
        self.k, self.G = cfg.rl.max_staleness, cfg.rl.groups_per_step
        self.engine, self.tokenizer = engine, tokenizer
        self.topics = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "dlq", "metrics")}
        self.producer = self.consumer = self.weights = self.metrics = self.slots = None
        self.commits: PromptCommits | None = None
        """Prompt offsets: ledger, commits, rebalance bookkeeping (``producers.commits``)."""
        self.ready: deque[Sample] = deque()  # admitted, not started
        self.running: dict[str, tuple[Sample, object]] = {}  # engine request id -> (sample, request)
        self.env_steps = EnvSteps(self.rc.env.workers, self.rc.env.step_timeout_s, turn_sync=self.rc.env.turn_sync)
        """``env.step`` calls in flight, each with a deadline (``producers.env_steps``; ``turn_sync``: a baseline)."""
        self.queue = PromptQueue(cfg.rollout.queue_samples or 16 * cfg.rollout.max_inflight)
        """Consumed prompt messages, not admitted yet (``rollout.queue_samples``)."""
        self.stats = {"trajectories": 0, "dlq": 0, "admitted_groups": 0, "loads": 0}
        self._last_work = time.monotonic()
        self._assigned_once = False
        """The group gave this worker partitions at least once: the idle clock runs from then."""
        self._last_produced: float | None = None  # the ``produce_gap_s`` window: the stage's pauses
        pf = cfg.rollout.prefetch_samples
        self._prefetch = cfg.rollout.max_inflight if pf is None else pf
        """Admitted samples kept beyond the free slots (look-ahead)."""
        self._per_msg = float(max(1, cfg.rl.group_size // max(1, cfg.rl.replicate)))
        """Samples per prompt message (smoothed): how many messages fit the free slots."""
        self.restarts = StaleRestarts.of(self.rc, cfg.rl.staleness_rule, self.k)
        self.hold = SampleHold() if self.restarts.finished else None
        """Finished samples held until their message's last one finishes (``rollout.restart_scope``)."""
        self.race = GroupRace(tail=self.rc.overprovision_tail == "train") if self.rc.overprovision else None
        """Over-provisioned messages: the first ``group_size`` samples to finish (``rollout.overprovision``)."""
        self._race_dropped: set[str] = set()
        """Engine request ids of aborted extra samples whose output the engine had already returned."""

    # -- lifecycle -------------------------------------------------------------------------------
    def setup(self) -> None:
        from pipeline.models import load_tokenizer, materialize

        self.write_resolved()
        model_dir = materialize(self.cfg.model)
        self.tokenizer = self.tokenizer or load_tokenizer(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        self.stop_ids = frozenset(self._stop_id(s) for s in (["\n"] if self.rc.env.stop is None else self.rc.env.stop))
        self.envs = {task: env_factory(spec, self.rc.env.import_dirs) for task, spec in self.rc.env.tasks.items()}
        for task, env_cls in self.envs.items():
            env_cls.check_options(self.rc.env.options.get(task, {}), self.rc.env.import_dirs)
        if self.rc.overprovision and self.envs:
            log.warning("rollout.overprovision applies to single-turn prompts only, not to %s", sorted(self.envs))
        if self.engine is None:
            ctx = EngineContext(model_dir, self.tokenizer, self.worker_id, self.rc.max_inflight)
            self.engine = build_engine(self.rc.engine, ctx)
        self.max_len = int(self.engine.max_model_len)
        cfg, wid = self.cfg, self.worker_id
        self.producer = Producer(client_conf(cfg, "rollout", wid, kind="producer"))
        self.metrics = WorkerMetrics(
            "rollout", wid, self.producer, self.topics["metrics"], self.rc.metrics_interval_s,
            self.rc.prometheus_port, labels={"engine": self.engine.name},
        )  # fmt: skip
        self.metrics.version = self.engine.version
        self.weights = WeightSync(cfg, wid, self.engine)
        if self.weights.catch_up(self.liveness.startup_timeout_s) is not None and self.weights.pending:
            self.weights.wait_loadable(self.liveness.slow_op_s)
            self._load()
        self.commits = PromptCommits(self.metrics, cfg.kafka.request_timeout_s + 30, self.section)
        self.slots = RolloutSlots.of(cfg)
        if self.slots is None or self.slots.take() is not None:
            self._join()
        else:
            log.info("spare: every rollout slot is held; waiting warm to take one over %s",
                     kv(worker=wid, slots=self.slots.n))  # fmt: skip
        self._last_work = time.monotonic()  # idle time counts from here, not from construction
        log.info("rollout worker started %s", kv(worker=wid, engine=self.engine.name, version=self.engine.version))

    def _join(self) -> None:
        """Join the rollout group on rl.prompts: a dynamic member, or a static one, under the slot held
        (``producers.slots``) or ``rollout.group_instance_id``."""
        cconf = {  # the user's kafka.consumer settings (in client_conf) win over these two
            "heartbeat.interval.ms": self.rc.heartbeat_interval_ms,
            "session.timeout.ms": self.rc.session_timeout_ms,
            **client_conf(self.cfg, "rollout", self.worker_id, kind="consumer"),
            "on_commit": self.commits.on_commit,
        }
        if self.slots is not None:
            cconf["group.instance.id"] = self.slots.instance_id(self.slots.held)
        elif self.rc.group_instance_id:  # restarted within the session timeout: its partitions at once
            cconf["group.instance.id"] = self.rc.group_instance_id
        self.consumer = Consumer(cconf, group_id=self.rc.group_id)
        self.startup_call(lambda: self.consumer.partitions(self.topics["prompts"]), "prompts topic")
        self._assigned_once = False
        self.commits.subscribe(
            self.consumer, self.topics["prompts"], self._drain, self.queue.drop, lambda: self.failed, self._assigned
        )

    def _assigned(self, _consumer, partitions) -> None:
        """Partitions assigned: prompts may come now, so the idle clock restarts. An empty
        assignment does not count: a cooperative rebalance first answers a joining member with
        nothing and hands it partitions in a second round, once their owner has let them go."""
        if partitions:
            self._assigned_once = True
            self._last_work = time.monotonic()

    def run_once(self) -> bool:
        if self.consumer is None:  # a spare (rollout.slots): warm, until a slot is free
            return spare_once(self)
        try:
            self._work_once(consume=True)
        except ConsumeError as exc:
            if self.slots is None or not Consumer.is_fenced_member(exc):
                raise
            self.slots.renew_fenced(self, exc)
            return True
        idle = self.rc.exit_when_idle_s
        if idle and not self._busy():
            # Until the group first gives it partitions the worker is waiting for its share, not
            # idle: on a loaded machine a join takes longer than a short exit_when_idle_s. A member
            # the group gives nothing (more workers than partitions) leaves at startup_timeout_s.
            limit = idle if self._assigned_once else max(idle, self.liveness.startup_timeout_s)
            if time.monotonic() - self._last_work > limit:
                why = "" if self._assigned_once else " without a partition assigned"
                log.info("idle for %.1fs%s, stopping", limit, why)
                return False
        return True

    def finish(self) -> None:
        """Finish the admitted samples, flush and commit, within the stop budget
        (``STOP_FLUSH_SHARE`` of ``liveness.shutdown_timeout_s``). What does not make it stays
        uncommitted and the next owner generates it again, as after a kill -9 (the trainer refuses a
        repeated trajectory_id): samples still unfinished when the budget ends, and every prompt if
        the broker does not acknowledge the trajectories in time (an outage; the queued ones are
        dropped, so the close does not wait for them either). A stop never waits out an outage."""
        if self.consumer is None:  # a spare holds nothing
            return
        try:
            unfinished = self._drain(lambda tp: True, budget_s=STOP_FLUSH_SHARE * self.liveness.shutdown_timeout_s)
        except DeliveryError as exc:
            if exc.kafka_error is not None:  # a real delivery failure, not a broker that is away
                raise
            dropped = self.producer.discard()
            self.metrics.inc("stop_unflushed", dropped)
            self.commits.hand_over()
            log.warning("the broker did not acknowledge every trajectory before the stop; their prompts are "
                        "left uncommitted for the next owner %s", kv(dropped=dropped, error=exc))  # fmt: skip
            return
        self.commits.commit(force=True)
        if unfinished:
            self.metrics.inc("stop_unfinished", unfinished)
            self.commits.hand_over()
            log.warning("the stop budget ended before every admitted sample finished; their prompts are left "
                        "uncommitted for the next owner %s", kv(samples=unfinished))  # fmt: skip

    def close(self) -> None:
        try:
            if self.consumer is not None:
                self.consumer.close()  # a final revoke: nothing left to drain
            if self.producer is not None:
                self.producer.close(self.cfg.kafka.request_timeout_s)
        finally:
            if self.slots is not None:  # after the consumer: a spare must not join beside it
                self.slots.release()
            if self.weights is not None:
                self.weights.close()
            self.env_steps.close()
            if self.metrics is not None:
                self.metrics.close()
            if self.engine is not None:
                self.engine.close()
        log.info("rollout worker stopped %s", kv(**self.stats))

    def result(self) -> dict:
        return self.stats

    def _stop_id(self, s: str) -> int:
        ids = self.tokenizer.encode(s, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"rollout.env.stop {s!r} must be exactly one token, it is {ids}")
        return ids[0]

    def _busy(self) -> bool:
        return bool(self.ready or self.running or self.env_steps or self.commits.outstanding() or self.queue)

    def _work_once(self, consume: bool) -> None:
        self._poll_weights()
        self._maybe_load()
        self._start_samples()
        if self.running:
            self._handle_outputs(self.engine.step(self.engine.step_wait_s))
        self._finish_env_steps()
        if self.env_steps.turn_sync and not (self.running or any(s.started_ms for s in self.ready)):
            self.env_steps.dispatch()  # the turn-synchronous baseline: the batch's env steps run now
        if consume:
            self._poll_prompts()
        elif not self.running:
            time.sleep(0.005)
        self._release()
        self.producer.poll(0)
        self.commits.commit()
        self.metrics.set("inflight", len(self.running) + len(self.env_steps))
        self.metrics.set("ready", len(self.ready))
        if self.hold is not None:
            self.metrics.set("held_samples", self.hold.held())
        self.metrics.set("queued_messages", len(self.queue))
        self.metrics.set("held_messages", self.queue.waiting(self._admissible))
        self.metrics.maybe_publish()

    # -- prompts ---------------------------------------------------------------------------------
    def _capacity(self) -> int:
        return self.rc.max_inflight - len(self.running) - len(self.env_steps) - len(self.ready)

    def _poll_prompts(self) -> None:
        """Take prompt messages into the queue; pause only the partitions whose share of it is full
        (why: ``producers.prompt_queue``)."""
        want_paused = self.queue.full(self.consumer.assignment())
        paused = self.consumer.paused()
        self.consumer.pause(want_paused - paused)
        self.consumer.resume(paused - want_paused)
        room = self.queue.room(self._per_msg)  # messages that fit
        idle = not (self.running or self.env_steps or self.ready)  # a queue waiting for admission is idle too
        wait_s = self.rc.poll_timeout_s if idle else 0.0
        if wait_s and self.weights.wait_fetch(wait_s):  # new weights on the way: load them as soon as
            wait_s = 0.0  # they are verified, not after a prompt poll (k = 0: bench trace, to generation)
        # consume even when full (partitions paused): it serves rebalance callbacks and max.poll.interval
        msgs = self._wait_prompts(max(1, min(room, 100)), wait_s)
        if msgs:
            assigned = self.consumer.assignment()
        for msg in msgs:
            self._last_work = time.monotonic()
            if (msg.topic(), msg.partition()) in assigned:  # not one revoked during this consume
                self._on_message(msg)

    def _wait_prompts(self, n: int, wait_s: float) -> list:
        """Up to ``n`` prompt messages, waiting at most ``wait_s`` for the first: in short polls (a
        poll returns at the first message, where a batch ``consume`` would wait out its timeout),
        between which rl.control is followed, so an idle worker starts on new weights or on the
        trainer's progress as soon as they are published, not after the rest of its wait."""
        msgs = self.consumer.consume(n, 0)
        deadline = time.monotonic() + wait_s
        while not msgs and (left := deadline - time.monotonic()) > 0:
            first = self.consumer.poll(min(left, IDLE_SLICE_S))
            if first is not None:
                return [first, *(self.consumer.consume(n - 1, 0) if n > 1 else [])]
            if self._poll_weights():
                break
        return msgs

    def _on_message(self, msg) -> None:
        tp = (msg.topic(), msg.partition())
        if self.commits.restart_if_rewound(tp, msg.offset()):
            self.queue.drop(lambda t: t == tp)
        try:
            prompt = self._parse(msg)
        except DecodeError as exc:  # undecodable, wrong schema, or a prompt that makes no sense
            gen = self.commits.track(tp, msg.offset(), 1)
            self._dead_letter(self.dead_letter(msg, exc.error_type, str(exc)), gen)
            return
        gen = self.commits.track(tp, msg.offset(), prompt["sample_count"] + self._published_extra(prompt))
        self._per_msg += 0.2 * (prompt["sample_count"] - self._per_msg)  # samples per message, smoothed
        if not self._admissible(prompt):
            self.metrics.inc("prompts_held")
            log.debug("holding %s", kv(group_seq=prompt["group_seq"], version=self.engine.version, k=self.k))
        self.queue.push(tp, msg.offset(), prompt, gen)

    def _parse(self, msg) -> dict:
        """The decoded, checked Prompt of ``msg`` with its token ids in ``_tokens``."""
        prompt = decode_message(msg, "Prompt")
        try:
            check_prompt(prompt)
        except InvalidRecord as exc:
            raise exc.located(msg.topic(), msg.partition(), msg.offset()) from exc
        prompt["_tokens"] = prompt_tokens(prompt, self.tokenizer, self.rc, self.max_len)
        env_cls = self.envs.get(prompt["task"])
        if env_cls is not None and env_cls.renders_chat:  # it renders the opening (e.g. with its tools): measure that
            prompt["_tokens"] = self._opening_tokens(env_cls, prompt, msg)
        return prompt

    def _opening_tokens(self, env_cls, prompt: dict, msg) -> list[int]:
        """The tokens of the opening a chat environment renders for ``prompt``; InvalidRecord
        (too_long) past ``rollout.max_prompt_tokens``. An environment whose reset raises is left to
        fail its episodes (each ends in a dead letter with the reason)."""
        ctx = EnvContext(prompt["task"], self.worker_id, self.tokenizer, tuple(self.rc.env.import_dirs))
        try:
            text = env_cls(self.rc.env.options.get(prompt["task"], {}), ctx).reset(dict(prompt), prompt["sample_start"])
        except Exception:  # the episode's own reset raises it again and dead-letters the episode
            return prompt["_tokens"]
        toks = self._tokenize(text, False)
        limit = min(self.rc.max_prompt_tokens, self.max_len - 1)
        if len(toks) > limit:
            exc = InvalidRecord(f"prompt has {len(toks)} tokens with the environment's opening (tools included), "
                                f"more than the limit {limit}", "too_long")  # fmt: skip
            raise exc.located(msg.topic(), msg.partition(), msg.offset())
        return toks

    def _admissible(self, prompt: dict) -> bool:
        return prompt["group_seq"] < 0 or self.weights.may_admit(prompt["group_seq"])

    def _extra(self, prompt: dict) -> int:
        """Samples drawn for the message beyond its own (``rollout.overprovision``): single-turn
        messages that carry their whole group only."""
        whole = prompt["sample_start"] == 0 and prompt["sample_count"] == prompt["group_size"]
        return self.rc.overprovision if self.race is not None and prompt["task"] not in self.envs and whole else 0

    def _published_extra(self, prompt: dict) -> int:
        """Of those, the ones published too (``rollout.overprovision_tail = "train"``): the message
        waits for their acknowledgements as well."""
        return self._extra(prompt) if self.race is not None and self.race.tail else 0

    def _admit(self, tp, offset: int, prompt: dict, gen: int) -> None:
        toks = prompt["_tokens"]
        budget = min(prompt["max_new_tokens"] or self.rc.max_new_tokens, self.max_len - len(toks))
        task = prompt["task"]
        env_cls = self.envs.get(task)
        extra, tail = self._extra(prompt), self._published_extra(prompt)
        if self.hold is not None:  # the message's own samples; a tail (below) is never held
            self.hold.admit((tp, offset, gen), prompt["sample_count"])
        drawn = []
        for i in range(prompt["sample_start"], prompt["sample_start"] + prompt["sample_count"] + extra):
            s = Sample(prompt, i, toks, budget, tp, offset, gen=gen)
            if tail:
                s.quorum, s.drawn = prompt["group_size"], prompt["group_size"] + tail
            drawn.append(s)
            if env_cls is not None:
                ctx = EnvContext(task, self.worker_id, self.tokenizer, tuple(self.rc.env.import_dirs))
                s.env = env_cls(self.rc.env.options.get(task, {}), ctx)
                s.max_turns, s.max_turn_tokens = self.rc.env.max_turns, self.rc.env.max_turn_tokens
            self.ready.append(s)
        if extra:
            self.race.admit((tp, offset, gen), drawn, prompt["sample_count"])
        self.stats["admitted_groups"] += 1
        self.metrics.inc("prompts_admitted")
        self.metrics.set("admitted_group_seq", prompt["group_seq"])
        self.metrics.set("admitted_at_version", self.engine.version)

    def _release(self) -> None:
        """Admit queued messages, oldest admissible group first, while the free slots and the
        look-ahead have room (one message regardless when nothing is running or ready)."""
        while self._capacity() + self._prefetch > 0 or not (self.running or self.env_steps or self.ready):
            got = self.queue.pop_oldest(self._admissible)
            if got is None:
                return
            tp, entry = got
            self._admit(tp, *entry)

    def _dead_letter(self, dead: dict, gen: int) -> None:
        """Produce DeadLetter ``dead`` (a bad prompt message, or an episode whose environment
        failed: ``Sample.dead_letter``); acked for its prompt message like a trajectory."""
        tp, off, why = (dead["source_topic"], dead["source_partition"]), dead["source_offset"], dead["error_type"]
        log.warning("dead letter %s", kv(partition=tp[1], offset=off, error_type=why, reason=dead["reason"][:200]))
        acker = self.commits.acker(tp, off, gen)
        self.producer.produce_record(self.topics["dlq"], "DeadLetter", dead, key=dead["key"], on_delivery=acker)
        self.stats["dlq"] += 1
        self.metrics.inc("dead_letters")
        self.metrics.inc(f"dead_letters.{why}")

    def _step_dead_letter(self, s: Sample, dead: dict) -> None:
        """Produce the DeadLetter of one failure inside an env step that did not end the episode
        (``info["dead_letters"]``: error_type, reason, value, headers), e.g. a tool call stopped
        at its deadline; not part of the prompt's acknowledgements."""
        why = dead["error_type"]
        log.warning("dead letter %s", kv(trajectory_id=s.tid, error_type=why, reason=dead["reason"][:200]))
        rec = {
            "source_topic": s.tp[0], "source_partition": s.tp[1], "source_offset": s.offset,
            "key": s.prompt["group_id"].encode(), "value": dead["value"],
            "headers": {"trajectory_id": s.tid.encode(), **dead.get("headers", {})},
            "error_type": dead["error_type"], "reason": f"trajectory {s.tid} (turn {s.turns}): {dead['reason']}",
            "role": self.role, "worker_id": self.worker_id, "failed_at_ms": now_ms(),
        }  # fmt: skip
        self.producer.produce_record(self.topics["dlq"], "DeadLetter", rec, key=rec["key"])
        self.metrics.inc("dead_letters")
        self.metrics.inc(f"dead_letters.{why}")

    # -- generation ------------------------------------------------------------------------------
    def _draining(self) -> bool:
        return self.weights.loadable is not None and self.rc.reload_policy == "drain"

    def _start_samples(self) -> None:
        if self._draining() or self.env_steps.stepping():
            return  # drain: no new turn until the new weights are in; turn_sync: until the env steps return
        while self.ready and len(self.running) + len(self.env_steps) < self.rc.max_inflight:
            s = self.ready.popleft()
            if s.start(self._tokenize, self.max_len):
                self._submit(s)
            else:
                self._publish(s)

    def _tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special).input_ids

    def _submit(self, s: Sample) -> None:
        chat_turns = self.rc.env.stop is None and s.env is not None and s.env.renders_chat
        req = s.request(self.rc.temperature, frozenset() if chat_turns else self.stop_ids, self.eos_id)  # chat: EOS
        if req.rid in self.running:  # the same sample of a copy of its message (e.g. fed twice) is in flight
            log.warning("a copy of this sample is generating (its prompt was delivered twice); both run %s",
                        kv(trajectory_id=s.tid, partition=s.tp[1], offset=s.offset))  # fmt: skip
            self.metrics.inc("duplicate_samples")
            base, n = req.rid, 1
            while req.rid in self.running:  # engine request ids must be unique among those in flight
                req.rid, n = f"{base}~{n}", n + 1
        self.running[req.rid] = (s, req)
        self.engine.submit(req)

    def _unknown_output(self, out) -> None:
        """An engine output for a request this worker does not know (an engine answering twice):
        logged, counted (``unknown_outputs``) and dropped; nothing waits for it, and a restart would
        not make it known, so raising would only crash-loop the worker."""
        log.warning("dropped an engine output of an unknown request %s",
                    kv(request=out.rid, tokens=len(out.tokens), finish=out.finish_reason))  # fmt: skip
        self.metrics.inc("unknown_outputs")

    def _handle_outputs(self, outs) -> None:
        for out in outs:
            if out.rid in self._race_dropped:  # an extra sample aborted after it had finished
                self._race_dropped.discard(out.rid)
                self.metrics.inc("overprovision_discarded_tokens", len(out.tokens))
                continue
            if out.rid not in self.running:
                self._unknown_output(out)
                continue
            s, _ = self.running.pop(out.rid)
            s.add_output(out, self.engine.version)
            self.metrics.inc("tokens_generated", len(out.tokens))
            if s.end_turn(out, self.eos_id):
                self.env_steps.submit(s, s.env.step, self.tokenizer.decode(out.tokens))
            else:
                self._publish(s)

    def _finish_env_steps(self) -> None:
        for step in self.env_steps.finished():
            s, res = step.sample, step.result
            if step.error_type is not None:  # this episode ends in a dead letter; the others go on
                s.failed = (step.error_type, step.reason)
                self.metrics.set("env_steps_abandoned", self.env_steps.abandoned)
                self._publish(s)
                continue
            for name, n in (res.info.get("counts") or {}).items():
                self.metrics.inc(f"env.{name}", n)
            for name, values in (res.info.get("observe") or {}).items():  # e.g. tool latencies: p50/max
                for v in values:
                    self.metrics.observe(f"env.{name}", v)
            s.env_metadata.update(res.info.get("metadata") or {})
            for dead in res.info.get("dead_letters") or ():  # a stopped tool call; the episode goes on
                self._step_dead_letter(s, dead)
            obs = self.tokenizer(res.observation, add_special_tokens=False).input_ids
            if s.add_observation(res, obs) and not self._draining():
                self._submit(s)
            elif s.finish is None:
                self.ready.appendleft(s)  # resumes after the weight load (started already)
            else:
                self._publish(s)

    def _publish(self, s: Sample) -> None:
        """``s`` has finished: produce it, or hold it until its message's last sample finishes."""
        s.finished_ms = now_ms()  # generation ended (a held sample is produced later)
        if self.race is None:
            self._hold(s)
            return
        passed, losers = self.race.finished(s)
        self._abort_extra(losers)
        for x in passed:
            if x.quorum and x.rank >= x.quorum:  # a tail sample: its group has closed, nothing waits for it
                self._produce(x)
            else:
                self._hold(x)

    def _abort_extra(self, losers: list[Sample]) -> None:
        """Stop the samples of an over-provisioned group that did not finish among its first
        ``group_size``: dropped from the queue, aborted in the engine; nothing is published or
        acknowledged for them (the prompt message expects ``group_size`` acknowledgements)."""
        if not losers:
            return
        ids = {id(x) for x in losers}
        self.ready = deque(x for x in self.ready if id(x) not in ids)
        rids = [rid for rid, (x, _) in self.running.items() if id(x) in ids]
        outs = self.engine.abort(rids) if rids else []
        mine = set(rids)
        discarded = sum(len(x.tokens) for x in losers) + sum(len(o.tokens) for o in outs if o.rid in mine)
        for rid in rids:
            self.running.pop(rid)
        # an output the engine returned before this abort is still on its way to _handle_outputs
        self._race_dropped.update(mine - {o.rid for o in outs})
        self.metrics.inc("overprovision_aborted_samples", len(losers))
        self.metrics.inc("overprovision_discarded_tokens", discarded)
        # others that finished before the abort reached the engine (the sim engine returns them): as usual
        self._handle_outputs([o for o in outs if o.rid not in mine])

    def _hold(self, s: Sample) -> None:
        """Produce ``s`` now, or hold it until its message's last sample finishes."""
        done = self.hold.finished(s) if self.hold is not None else [s]
        again = self.restarts.likely_lost(s, done, self.engine.version) if len(done) > 1 else []
        if again:  # the message waits for them again
            self.hold.reopen(s, done, again)
            self._regenerate(again)
            return
        for x in done:
            self._produce(x)

    def _produce(self, s: Sample) -> None:
        rec = s.trajectory(self.tokenizer, self.worker_id, self.engine.name, self.engine.version)
        if s.failed is not None:  # its environment failed
            self._dead_letter(s.dead_letter(rec, self.role, self.worker_id), s.gen)
            return
        self.producer.produce_record(
            self.topics["rollouts"],
            "Trajectory",
            rec,
            key=rec["group_id"].encode(),
            on_delivery=self.commits.acker(s.tp, s.offset, s.gen),
        )
        self.stats["trajectories"] += 1
        self.metrics.inc("trajectories")
        self.metrics.observe("gen_latency_ms", rec["gen_finished_at_ms"] - rec["gen_started_at_ms"])
        self._last_work = now = time.monotonic()
        if self._last_produced is not None:
            self.metrics.observe("produce_gap_s", now - self._last_produced)
        self._last_produced = now

    # -- weights ---------------------------------------------------------------------------------
    def _poll_weights(self) -> bool:
        """Follow rl.control (``WeightSync.poll``); True if a record was read or a fetch ended."""
        had = self.weights.loadable
        moved = self.weights.poll()
        if self.weights.loadable is not None and self.weights.loadable is not had:
            self.metrics.observe("weight_fetch_ms", self.weights.fetch_ms)
        if self.weights.admission_moves():
            self._release()
        return moved

    def _maybe_load(self) -> None:
        if self.weights.loadable is None:
            return
        if self.rc.reload_policy == "interrupt" and self.running:
            finished = []
            for out in self.engine.abort():
                if out.rid not in self.running:
                    self._unknown_output(out)
                    continue
                s, req = self.running[out.rid]
                if out.tokens and (out.tokens[-1] in req.stop_ids or len(out.tokens) >= req.max_new_tokens):
                    # it had finished before the abort reached it: a normal end of turn
                    reason = "length" if out.tokens[-1] not in req.stop_ids else "stop"
                    finished.append(GenOutput(out.rid, out.tokens, out.logprobs, reason))
                    continue
                self.running.pop(out.rid)
                s.add_output(out, self.engine.version)
                if self.restarts.doomed(s, self.weights.loadable[0]["version"]):
                    self.metrics.inc("restarted_samples")
                    self.metrics.inc("restart_discarded_tokens", s.restart())
                self.ready.appendleft(s)  # resumed by the next _start_samples, under the new weights
                self.metrics.inc("interrupted")
            self._handle_outputs(finished)
        if self.running or self.engine.inflight():
            return  # drain: wait for the engine to empty
        self._load()
        self._restart_finished()
        self._release()

    def _restart_finished(self) -> None:
        """Restart the held finished samples that the trainer would drop at the version just loaded
        plus ``restart_margin`` (``StaleRestarts.held_doomed``); they go first in the queue, since
        their message waits for them, and now run beside the sample it still waits for."""
        if self.hold is None:
            return
        version = self.engine.version
        self._regenerate(self.hold.take(lambda s: self.restarts.held_doomed(s, version)))

    def _regenerate(self, samples: list[Sample]) -> None:
        for s in samples:
            self.metrics.inc("regenerated_samples")
            self.metrics.inc("regenerate_discarded_tokens", s.restart())
            self.ready.appendleft(s)

    def _load(self) -> None:
        with self.section("weight load"):
            upd, total_ms, swap_ms = self.weights.load()
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

    # -- rebalances (``producers.commits`` calls it) ------------------------------------------------
    def _drain(self, pred, budget_s: float | None = None) -> int:
        """Finish every admitted sample of partitions matching ``pred`` and wait for their acks (the
        commit is the caller's); their queued, unadmitted messages are left to the next owner. The
        wait for acks rides out a broker outage (``liveness.outage_s``). With ``budget_s`` (a stop)
        samples are finished for two thirds of it, and the acks waited for until it ends, else
        DeliveryError. Returns how many samples are left unfinished."""
        self.queue.drop(pred)
        t0 = time.monotonic()

        def pending() -> int:
            running = [s for s, _ in self.running.values()]
            return sum(1 for s in [*self.ready, *running, *self.env_steps.samples()] if pred(s.tp))

        while pending() and (budget_s is None or time.monotonic() - t0 < budget_s * 2 / 3):
            self.beat()
            self._work_once(consume=False)
        wait_s = self.liveness.outage_s if budget_s is None else max(0.5, t0 + budget_s - time.monotonic())
        self.producer.flush_patiently(wait_s, "trajectories")
        return pending()


def run(cfg, stop=None) -> dict:
    """Run one rollout worker until ``stop`` is set, SIGTERM/SIGINT, or ``exit_when_idle_s``."""
    stats = RolloutWorker(cfg).run(stop)
    print(json.dumps(stats), flush=True)
    return stats
