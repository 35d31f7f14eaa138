"""``rlstream chaos``: a fault run. The real roles run as supervised processes (as ``rlstream demo``
runs them: the demo's task, model and settings) against a broker this command controls, while a
seeded random schedule of faults hits them; then the run drains and is audited from the topics.

Phases:
1. **warm-up**: the local KRaft broker (``<out>/broker``, a free port kept across restarts) or
   ``--bootstrap``; fresh topics; trainer, reward and rollout workers start. When every one has
   published a MetricEvent the concurrent auditor (``rlstream.dev.chaos_live``: a separate process
   reading rl.rollouts and rl.scored in read_committed as the run goes) and then the feed start (N
   groups at a rate that spans most of the chaos phase), and the chaos clock starts.
2. **chaos** (``duration_s``): kill -9 of random roles at random moments (the trainer and the feed
   included; the supervisor restarts them, and records the exit as ours, not as a crash), broker
   restarts (stop by PID, 10-20 s down, start on the same data dir and port; skipped with
   ``--bootstrap``), join/leave cycles (an extra rollout and reward worker, later stopped with
   SIGTERM), bursts of bad records (``rlstream.dev.fuzz``) in rl.prompts, rl.rollouts and rl.scored,
   and the faults of the fault classes (``rlstream.dev.chaos_faults``: network partitions and
   latency, a full or slow weights store, SIGSTOP and OOM kills), each ended by its class. The
   phase does not end while a class's fault is in force, and every class ends its faults when the
   harness exits, however it exits.
3. **drain**: no more faults; the trainer runs to ``trainer.max_steps = N / G`` and exits 0, which
   happens exactly when every group has been trained (deadline ``drain_s``).
4. **audit** (``rlstream.dev.chaos_audit``), from the topics and the trainer's steps log, while the
   broker still runs; the live auditor reads on to the end and stops, and what it saw is checked
   against the final read (``chaos_live.check``); then everything is stopped by PID.

The sizes, the options and the seeded fault schedule: ``rlstream.dev.chaos_plan``; the fault
classes: ``rlstream.dev.chaos_faults``; the report: ``rlstream.dev.chaos_report``.

Output: progress lines on stderr (at the end, one per fault kind: how many, the roles that saw it,
the trainer's longest pause, the line said on screen), the availability line and the verdict line
on stdout, ``<out>/report.json``, the run's
timeline picture ``<out>/timeline.png`` and the role logs (``<out>/logs``, with the supervisor's
``events.jsonl``); with ``--docs PAGE``, the page's ``<!-- chaos:<size> -->`` block regenerated
(``rlstream.dev.chaos_docs``). Exit code 0 on PASS.
Not a benchmark, and not a substitute for the unit tests of each role.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path

from rich.markup import escape

from pipeline.config import load_tree, merge, settings_tree, validate
from pipeline.log import kv, setup_logging
from pipeline.topology import RunIdentity
from rlstream.demo import TASK, demo_settings, write_task
from rlstream.dev import chaos_audit, chaos_docs, chaos_live
from rlstream.dev.chaos_broker import BrokerOps, ClusterOps
from rlstream.dev.chaos_faults import ChaosContext, FaultClasses, fronts, run_settings
from rlstream.dev.chaos_plan import BASE_ROLES, TASK_RECORDS, WORKERS, ChaosOptions, Fault, plan_faults
from rlstream.dev.chaos_report import code_fingerprint, write_report
from rlstream.launcher import Launcher, RoleSpec, standard_roles
from rlstream.supervisor import RestartPolicy

log = logging.getLogger(__name__)
CHAOS_SETTINGS = {  # below the user's --config/--set: a fault run's liveness bounds
    "liveness.watchdog_s": 30,
    # the product's default stop bound: a stop that lands in a transaction call wedged after a broker
    # restart waits out that call's own bound (send_offsets: 10 s + 15 s grace) first; at 20 s a
    # leaving worker was cut short as hung there (once in a CI run)
    "liveness.shutdown_timeout_s": 30,
    "liveness.slow_op_s": 300,
    # a group waits this long for its last samples: a kill -9 or a broker restart delays them by a
    # session timeout (45 s) plus a restart; the demo's 60 s would close groups early
    "trainer.group_timeout_s": 300,
}


FUZZ_BY = 0.85
"""Bad records still planned when the trainer reaches this share of its steps are written at once: the
job ends with the trainer's last step, and records written after a stage's last read get no dead
letter (the audit counts those as unread, ``chaos_audit.read_positions``)."""


class Chaos:
    """The fault schedule, run from the launcher's watch loop (``tick``)."""

    def __init__(self, cfg, launcher, p: dict, faults: list[Fault], broker_ops, injector, opts, console, classes):
        self.cfg, self.launcher, self.p, self.opts, self.console = cfg, launcher, p, opts, console
        self.classes: FaultClasses = classes
        """The fault classes: their faults are in ``faults``; ``_do`` hands each to its class."""
        faults = sorted(faults + classes.faults, key=lambda f: f.at)
        self.pending, self.faults = list(faults), faults
        self.broker_ops, self.injector, self.rng = broker_ops, injector, random.Random(opts.seed + 1)
        from consumers.trainer.state import TrainerCheckpoints, trainer_root
        from producers.slots import RolloutSlots, slot_root

        self._ckpts = TrainerCheckpoints(trainer_root(cfg))
        """The trainer's checkpoint dir: its lock names the trainer that is active (``standby``)."""
        self._slots = RolloutSlots(slot_root(cfg), 2) if opts.rollout_standby else None
        """The rollout slots: each lock names the worker that holds it (``rollout_standby``)."""
        self.phase, self.t_start = "warm-up", time.monotonic()
        self.live: chaos_live.LiveAuditor | None = None
        self.t0 = self.t_drain = None
        self.wall: dict[str, float] = {}
        """Wall-clock start of the chaos phase and of the drain (``availability``)."""
        self.phases: dict[str, float] = {}
        unit = math.lcm(cfg.rl.groups_per_step, TASK_RECORDS)
        faults_planned = p.get("broker_restarts") or p.get("kills") or p.get("joins") or classes.faults
        self.held = unit if faults_planned and p["groups"] >= 2 * unit else 0
        """Groups the feed keeps back until every planned fault is done: without them a trainer that
        finished first (a loaded machine; a slow rolling restart; a quiet machine that outran the paced
        plan: a scale run ended with 6 of its 40 kills and a leave still due) left faults undone."""
        self.held_from = (p["groups"] - self.held) // cfg.rl.groups_per_step if self.held else 0
        """The last step of the groups fed before the release: when the trainer reached it before the
        release, the wait from there to the release is taken out of the availability figures."""

    # -- the loop --------------------------------------------------------------------------------
    def tick(self) -> str | None:
        now = time.monotonic()
        if self.injector is not None:
            self.injector.poll()
        if self.t0 is not None:
            self.classes.poll(now - self.t0)
        return self._tick(now)

    def _tick(self, now: float) -> str | None:
        if self.phase == "warm-up":
            if self._pipeline_up():
                self.phases["warmup_s"] = round(now - self.t_start, 1)
                if self.live is not None:  # the concurrent read_committed auditor, before the first prompt
                    self.live.start()
                self.launcher.add_role(RoleSpec("feed", "feed", {"feed.limit": self.p["groups"] - self.held}, True))
                self.phase, self.t0 = "chaos", now
                self.wall["chaos"] = time.time()
                self.say(f"chaos phase: {len(self.pending)} faults over {self.p['duration_s']:.0f} s")
            elif now - self.t_start > self.opts.warmup_s:
                return f"failed: the roles did not all start within {self.opts.warmup_s:.0f} s"
            return None
        if self.phase == "chaos":
            t = now - self.t0
            steps = self.launcher.progress.steps
            if steps and steps[-1]["step"] >= FUZZ_BY * self.cfg.trainer.max_steps:
                for f in self.pending:  # the rest of the bad records now, while every stage still reads
                    if f.kind == "fuzz":
                        f.at = min(f.at, t)
            for f in [f for f in self.pending if f.at <= t]:
                self._do(f, t)
            self._release_held(t)
            quiet = not self.broker_ops.busy and not self.classes.busy
            if not self.pending and t >= self.p["duration_s"] and quiet and not self.held:
                self.phase, self.t_drain = "drain", now
                self.wall["drain"] = time.time()
                self.phases["chaos_s"] = round(now - self.t0, 1)
                self.say("drain: no more faults; waiting for the trainer to finish")
        elif self.phase == "drain" and now - self.t_drain > self.opts.drain_s:
            return f"failed: drain timed out ({self.opts.drain_s:.0f} s) before the trainer reached its last step"
        return None

    def _release_held(self, t: float) -> None:
        """Feed the held-back groups once no fault is still planned (kills, broker faults, joins,
        leaves, bad records) or running and the first feed has finished (two feeds of one name never
        run at once: the second continues from its state). Every fault is due by 90 % of the phase,
        or given up 120 s after it, so the hold ends."""
        if not self.held or self.broker_ops.busy or self.classes.busy or self.pending:
            return
        if not _finished(self.launcher.sup, "feed"):
            return
        self.launcher.add_role(RoleSpec("feed-rest", "feed", {"feed.limit": self.p["groups"]}, True))
        self.say(f"every planned fault done at {t:.0f} s: feeding the last {self.held} groups")
        self.held, self.wall["released"] = 0, time.time()

    def _pipeline_up(self) -> bool:
        ids = {f"trainer/{self.cfg.trainer.trainer_id}"}
        ids |= {f"{r.split('-')[0]}/{r}" for r in BASE_ROLES if r.startswith(("rollout", "reward"))}
        return ids <= set(self.launcher.progress.workers)

    def _do(self, f: Fault, t: float) -> None:
        sup = self.launcher.sup
        late = t > self.p["duration_s"] + 120  # give up on a fault that could not happen in time
        owner = self.classes.owner(f)
        if owner is not None:
            outcome = owner.do(f, t)
            if outcome is not None:
                return self._done(f, t, outcome)
            if late:
                return self._done(f, t, f"skipped: {f.kind} of {f.target or 'the run'} could not start in time")
            f.at = t + self.rng.uniform(2, 6)  # not possible right now (restarting, another in force)
        elif f.kind == "kill":
            target = f.target
            if not f.required and target == "feed" and _finished(sup, "feed"):
                target = f.target = self.rng.choice([r for r in BASE_ROLES if r != "feed"])
            if target == "trainer" and self.opts.standby:  # the active one, never the idle standby
                target = sup.name_of(self._ckpts.holder()) or target
            slot = target.removeprefix("rollout-")
            if self._slots is not None and slot.isdigit():  # the slot's holder, never the idle spare
                target = sup.name_of(self._slots.holder(int(slot))) or target
            if self._stopped(target) and not late:  # a kill -9 now would end the stop's test (the zombie's wake)
                f.at = t + self.rng.uniform(2, 15)
                return None
            pid = sup.inject(target, cause="chaos kill -9")
            if pid is not None:
                return self._done(f, t, f"kill -9 {target} (pid {pid})")
            if late or (target == "feed" and _finished(sup, "feed")):
                return self._done(f, t, f"skipped: {target} not running")
            f.at = t + self.rng.uniform(2, 15)  # restarting now: strike again a bit later
        elif f.kind == "broker":
            if self.broker_ops.broker is None:
                return self._done(f, t, "skipped: --bootstrap (not our broker)")
            if not self.broker_ops.busy:
                self.broker_ops.restart(f.arg, t, f.target)
                return self._done(f, t, f"broker {f.target or 'restart'}, {f.arg:.0f} s")
            f.at = t + 5
        elif f.kind == "join":
            for r in standard_roles(self.cfg, 1, 1):  # as the demo runs workers, under another name
                if r.name in ("rollout-0", "reward-0"):
                    name = f"{r.name[:-2]}-{f.target}"
                    # a joiner is a dynamic member (no group.instance.id): its leave rebalances at once,
                    # as an autoscaled worker's should
                    own = {k: v.replace(r.name, name) for k, v in r.settings.items() if "group_instance_id" not in k}
                    self.launcher.add_role(RoleSpec(name, r.command, own))
            return self._done(f, t, f"joined rollout-{f.target}, reward-{f.target}")
        elif f.kind == "leave":
            names = [f"rollout-{f.target}", f"reward-{f.target}"]
            for name in names:  # SIGTERM; the supervisor records the exit (or SIGKILLs after the timeout)
                sup.retire(name, self.cfg.liveness.shutdown_timeout_s + 15, cause="chaos leave (SIGTERM)")
            left = [n for n in names if n in sup.children]  # restarting right now: again shortly
            if not left:
                return self._done(f, t, f"SIGTERM rollout-{f.target}, reward-{f.target}")
            if late:
                return self._done(f, t, f"skipped: {left} not running")
            f.at = t + 3
        elif f.kind == "fuzz":
            n = self.injector.inject(int(f.arg))
            return self._done(f, t, f"{n} bad records")

    def _stopped(self, name: str) -> bool:
        """Whether a fault class SIGSTOPped ``name`` and has not SIGCONTed it yet (the supervisor's events)."""
        for e in reversed(self.launcher.sup.events):
            if e.get("name") == name and e["event"] == "signal" and e.get("signal") in ("SIGSTOP", "SIGCONT"):
                return e["signal"] == "SIGSTOP"
        return False

    def _done(self, f: Fault, t: float, outcome: str) -> None:
        f.outcome, f.t_done = outcome, round(t, 1)
        self.pending.remove(f)
        log.info("fault %s", kv(t=f.t_done, kind=f.kind, outcome=outcome))

    # -- reporting -------------------------------------------------------------------------------
    def done_counts(self, sup_summary: dict, fuzz_injected: int) -> dict:
        kills = sup_summary["kills"]
        return {
            "kills": sup_summary["kills_total"],
            "trainer_kills": kills.get("trainer", 0),
            "feed_kills": kills.get("feed", 0),
            "broker_restarts": sum(1 for r in self.broker_ops.done if r.get("ok")),
            "joins": sum(1 for f in self.faults if f.kind == "leave" and f.outcome and f.outcome.startswith("SIGTERM")),
            "fuzz": fuzz_injected,
            **self.class_counts(),
            "worker_kills": min(  # the fewest kills of one base worker (a size's minimum for each)
                sum(
                    1
                    for e in self.launcher.sup.events
                    if e["event"] == "signal" and e.get("signal") == "SIGKILL" and e.get("name") == w
                )
                for w in WORKERS
            ),
        }

    def class_counts(self, planned: bool = False) -> dict[str, int]:
        """Per kind of the fault classes' planned faults: how many were planned, or done (started)."""
        mine = [f for f in self.classes.faults]
        counts = dict.fromkeys(sorted({f.kind for f in mine}), 0)
        for f in mine:
            counts[f.kind] += 1 if planned else bool(f.outcome and "skipped" not in f.outcome.split(":")[0])
        return counts

    def line(self) -> str:
        now = time.monotonic()
        t = now - (self.t_drain or self.t0 or self.t_start)
        steps = self.launcher.progress.steps
        done = [f for f in self.faults if f.outcome and not f.outcome.startswith("skipped")]
        kills = sum(1 for f in done if f.kind == "kill")
        return escape(
            f"[chaos] {self.phase} {t:4.0f}s step {steps[-1]['step'] if steps else 0}/{self.cfg.trainer.max_steps} "
            f"kills={kills} broker_restarts={len(self.broker_ops.done)} "
            f"joins={sum(1 for f in done if f.kind == 'join')} "
            f"fuzzed={len(self.injector.records) if self.injector else 0} "
            + "".join(f"{k}={n} " for k, n in self.class_counts().items())
            + (f"in_force={','.join(self.classes.busy_kinds())} " if self.classes.busy else "")
            + f"pending={len(self.pending)} "
            f"restarts={self.launcher.sup.restarts_total if self.launcher.sup else 0} lag={self.launcher.lags}"
        )

    def say(self, msg: str) -> None:
        self.console.print(f"[chaos] {msg}", highlight=False, markup=False)


def _finished(sup, name: str) -> bool:
    c = sup.children.get(name)
    return c is not None and c.restart_at is None and c.proc.poll() == 0


class _ChaosLauncher(Launcher):
    chaos: Chaos | None = None

    def _line(self) -> str:
        return self.chaos.line() if self.chaos else super()._line()

    def watch(self, sup, metrics, tick=None):
        """The launcher's watch loop; when it ends other than ``ok`` (a failure, an interrupt, an
        error), every fault is ended before the roles are stopped: none is stopped while SIGSTOPped,
        partitioned or on a full disk (an ``ok`` run has none in force: the drain waits for them)."""
        status = None
        try:
            status = super().watch(sup, metrics, tick)
            return status
        finally:
            if self.chaos is not None and (status != "ok" or self.chaos.classes.busy):
                self.chaos.classes.close()


def resolve(config_path, sets, run_dir: Path, run_id: str, bootstrap: str, p: dict):
    """The run's config: the demo's settings < fault-run liveness < the user's file/env/--set < the run's own."""
    from rlstream.config import Config

    tree = settings_tree(demo_settings(run_dir, run_id))
    merge(tree, settings_tree(CHAOS_SETTINGS))
    merge(tree, load_tree(config_path or os.environ.get("RLSTREAM_CONFIG"), sets, dict(os.environ)))
    g = tree.get("rl", {}).get("groups_per_step", 8)
    feed_span = 0.8 * p["duration_s"]
    own = {
        **run_settings(run_dir, p),  # what the planned fault classes need (a store they can fault)
        **RunIdentity.of_prefix(f"chaos-{run_id}.").settings(),  # topics, groups, transactional ids
        "feed.epochs": p["groups"] // TASK_RECORDS,  # the feed's total, also across its restarts
        "feed.limit": p["groups"],
        "feed.rate": 0 if p.get("unpaced") else round(p["groups"] / feed_span, 4),
        "trainer.max_steps": p["groups"] // g,
        "run_dir": str(run_dir),
        "kafka.bootstrap_servers": bootstrap,
        # on a cluster: every topic on 3 replicas, an acks=all write needs 2 (one node may be down)
        **({"topics.replication_factor": 3, "topics.min_insync_replicas": 2} if p.get("nodes", 1) > 2 else {}),
    }
    return validate(Config, merge(tree, settings_tree(own)))


def run(config_path: Path | None, sets: list[str], opts: ChaosOptions) -> dict:
    """The fault run; returns the report (``verdict`` PASS or FAIL)."""
    from rich.console import Console

    from consumers.trainer.state import read_steps_log
    from pipeline.models import load_tokenizer, materialize
    from rlstream.broker_cluster import local_broker
    from rlstream.config import BrokerConfig, load_config
    from rlstream.dev.fuzz import Injector

    setup_logging("INFO")
    console = Console(stderr=True, soft_wrap=True)
    command, host = chaos_docs.command_line(opts, config_path, sets), chaos_docs.machine_info()
    t_start, code_at_start = time.monotonic(), code_fingerprint()
    base = load_config(config_path, sets)
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = Path(opts.out or Path(base.run_dir) / f"chaos-{run_id}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_task(run_dir / "task.jsonl")
    p = opts.plan(base.rl.groups_per_step)
    rng = random.Random(opts.seed)
    bcfg = BrokerConfig(port=0, data_dir=run_dir / "broker", heap_mb=512, nodes=opts.nodes)
    broker = None if opts.bootstrap else local_broker(bcfg)
    in_front = fronts(broker, p)  # before the broker starts: the network faults' proxy, which it advertises
    say = lambda m: console.print(f"[chaos] {m}", highlight=False, markup=False)  # noqa: E731
    ops = BrokerOps(broker, say)
    chaos = injector = live = classes = None
    status, audit, steps, live_r = "failed: did not start", None, [], None
    try:
        bootstrap = opts.bootstrap or broker.start(progress=ops.say, owned=True)["bootstrap"]
        cfg = resolve(config_path, sets, run_dir, run_id, bootstrap, p)
        if opts.nodes > 1 and broker is not None:  # what each killed node led or coordinated, in its record
            topics = [cfg.topics.name(r) for r in ("prompts", "rollouts", "scored", "control")]
            groups = [cfg.reward.group_id, cfg.rollout.group_id, cfg.trainer.group_id]
            ops = ClusterOps(broker, say, topics, groups)
        p["groups_per_step"], p["max_steps"] = cfg.rl.groups_per_step, cfg.trainer.max_steps
        ops.say(f"run dir {run_dir}; plan {json.dumps(p)}")
        vocab = len(load_tokenizer(materialize(cfg.model)))
        injector = Injector(cfg, p["fuzz"], random.Random(opts.seed + 2), vocab, TASK)
        # the classes plan (and prepare: a tmpfs under the store, the roles' environment) before any role starts
        ctx = ChaosContext(cfg, None, run_dir, ops, say, None)
        classes = FaultClasses(ctx, p, p["duration_s"], opts.seed)
        # the feed starts with the chaos clock
        roles = [
            r
            for r in standard_roles(cfg, 2, 2, trainer_standby=opts.standby, rollout_standby=opts.rollout_standby)
            if r.name != "feed"
        ]
        launcher = _ChaosLauncher(
            cfg, run_dir, roles, title="rlstream chaos", live=False, console=console, policy=RestartPolicy()
        )
        classes.set_launcher(launcher)
        chaos = launcher.chaos = Chaos(
            cfg, launcher, p, plan_faults(p, rng, p["duration_s"]), ops, injector, opts, console, classes
        )
        live_topics = {r: cfg.topics.name(r) for r in chaos_live.ROLES}
        live = chaos.live = chaos_live.LiveAuditor(cfg.kafka, live_topics, run_dir)
        try:
            status = launcher.run(tick=chaos.tick)["status"]
        finally:  # every fault ended (roles SIGCONTed, partitions healed) before anything else
            classes.close()
        chaos.phases["drain_s"] = round(time.monotonic() - (chaos.t_drain or time.monotonic()), 1)
        ops.wait()
        if broker is not None and broker.state() is None:
            ops.ensure_running()  # the audit reads the topics
        injector.flush(60)
        ops.say("stopping the live auditor (it reads on to the end offsets first)")
        live_done = live.stop()
        t_audit = time.monotonic()
        ops.say("auditing the topics and the steps log")
        data = chaos_audit.read_topics(cfg)
        try:
            read_upto = chaos_audit.read_positions(cfg)
        except Exception as exc:  # then every bad record counts as read: the stricter audit
            log.warning("cannot read the groups' committed offsets (%s): every bad record counts", exc)
            read_upto = None
        steps = read_steps_log(Path(cfg.trainer.checkpoint_dir or run_dir / "trainer"))
        topics = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "scored")}
        audit = chaos_audit.audit(
            data,
            steps,
            injector.records,
            topics=topics,
            feed=cfg.feed.name,
            expected_groups=p["groups"],
            k=cfg.rl.max_staleness,
            read_upto=read_upto,
        )
        skip = {(f["partition"], f["offset"]) for f in injector.records if f["topic"] == "scored"}
        live_r = chaos_live.check(live.rows(), data, skip, live_done)
        chaos.phases["audit_s"] = round(time.monotonic() - t_audit, 1)
    finally:
        if classes is not None:
            classes.close()  # a run that failed before its launcher ran: the store's tmpfs unmounted
        if live is not None:
            live.kill()
        if injector is not None:
            injector.close()
        ops.wait()
        if broker is not None:
            broker.stop(progress=ops.say)
        for obj in in_front:  # after the broker: the audit read through it
            obj.close()
            if not opts.keep_data:
                shutil.rmtree(run_dir / "broker" / "logs", ignore_errors=True)
    changed = sorted({f for f, _ in code_fingerprint().items() ^ code_at_start.items()})
    return write_report(
        run_dir, opts, p, status, (audit, live_r), chaos, injector, ops, bootstrap, time.monotonic() - t_start,
        changed, steps, (command, host),
    )  # fmt: skip
