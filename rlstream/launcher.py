"""Run a whole pipeline on one machine: the feed, N rollout workers, M reward workers and the trainer
as supervised ``rlstream`` processes, with a live view, restarts, and a report at the end.

Steps (each a method of ``Launcher``), once ``run`` holds the job's lease (``rlstream.lease``: a
second launch of a running job is refused before it writes or starts anything): ``prepare``
(topics, the model built once, the resolved config written to the run dir; a role with settings
of its own, such as its worker id, gets its own file, ``roles/<name>.toml``) → ``start_roles`` →
``watch`` (fold rl.metrics into ``Progress``, refresh lags, restart dead or hung roles, stop when
the trainer finishes and, with an eval role, its final version is evaluated, or fail when the run
stalls: see below) → ``stop_roles`` →
``write_report``. ``run(tick=...)`` calls ``tick()`` once per watch round, so a caller can act on
the live run (``rlstream chaos`` injects its faults there and adds roles with ``add_role``); a
string it returns ends the watch with that status. A role counts as hung when its process is alive but has published no
MetricEvent for ``hang_after_s`` after its first one (its own watchdog normally catches hangs
first and exits, see ``pipeline.worker``); it is SIGKILLed and restarted like a dead one.

The launcher also follows the job's DLQ topic (with the metrics, one consumer, never blocking the
loop) into a ``rlstream.stall.StallWatch``: dead letters by reason with their first message and a
stage with work and no progress are shown; no trainer step for ``liveness.stall_s`` while dead
letters arrive ends the run with ``failed: stalled: ...``.

This is the application layer behind ``rlstream demo`` (and job runs). It is not a cluster
launcher: for several machines run the roles yourself (docs/how-to/multi-machine.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from consumers.tracking.worker import Tracker
from consumers.trainer.state import has_checkpoint
from pipeline import codec
from pipeline.admin import Admin, ensure_topics
from pipeline.config import dump_toml, with_settings
from pipeline.errors import DecodeError, RlstreamError
from pipeline.kafka import Consumer, TopicPartition, client_conf, client_log_to
from pipeline.log import kv
from pipeline.notice_auth import ensure_key
from pipeline.topology import stage_lags
from rlstream.forkserver import FIRST_COMMANDS, ForkServer
from rlstream.lease import JobLease
from rlstream.progress import Progress, mean_reward, render
from rlstream.report import plot_report, write_report
from rlstream.role_states import RoleStates
from rlstream.stall import StallWatch
from rlstream.supervisor import ChildDied, RestartPolicy, Supervisor

log = logging.getLogger(__name__)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def role_env() -> dict[str, str]:
    """The environment of the roles: this process's without its ``RLSTREAM_*`` settings (the run's
    config file carries them) but for the home and cache dirs, and one thread each."""
    keep = ("RLSTREAM_HOME", "RLSTREAM_CACHE")
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_") or k in keep}, **CHILD_ENV}


def start_fork_server(cfg) -> ForkServer | None:
    """The job's fork server (``job.fork_server``; Linux), importing in the background from now."""
    if not cfg.job.fork_server or not sys.platform.startswith("linux"):
        return None
    forks = ForkServer({**role_env(), "RLSTREAM_PARENT_PID": str(os.getpid())}, preload_modules(cfg.model))
    log.info("fork server starting %s", kv(pid=forks.proc.pid))
    return forks


@contextlib.contextmanager
def early_fork_server(cfg):
    """``start_fork_server`` for a job command (``rlstream run``, ``demo``): started as soon as the
    config is read, so its imports overlap the checks, the broker's start and the job's lease;
    stopped when the command ends."""
    forks = start_fork_server(cfg)
    try:
        yield forks
    finally:
        if forks is not None:
            forks.close()


def preload_modules(model) -> list[str]:
    """What the fork server imports for a job: every role's modules and the model's own code (its
    ``model_type``'s modeling module; tiny models are Llamas)."""
    from pipeline.model_import import resolve_model_path
    from pipeline.models import PretrainedModelConfig
    from rlstream.forkserver import ROLE_MODULES

    kind = "llama"
    if isinstance(model, PretrainedModelConfig):
        try:
            kind = json.loads((resolve_model_path(model.path) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, RlstreamError):  # prepare() reports a missing model; this is only a preload
            kind = None
    return [*ROLE_MODULES, *([f"transformers.models.{kind}.modeling_{kind}"] if isinstance(kind, str) else [])]


@dataclass
class RoleSpec:
    name: str
    """Process name (log file ``logs/<name>.log``); also the worker id of rollout/reward workers."""
    command: str
    """rlstream subcommand: feed | rollout | reward | train."""
    settings: dict[str, Any] = field(default_factory=dict)
    """This process's own settings over the run's config, dotted key -> value (its worker id, ...):
    it is started with its own resolved config file, ``<run dir>/roles/<name>.toml``."""
    may_exit: bool = False
    """The role finishes by itself (feed, trainer): exit 0 is not a death."""
    metrics_port: int = 0


def metrics_port_block(rollout_workers: int, reward_workers: int) -> int:
    """The width of each role's block of Prometheus ports: 10, or more for more workers of a kind."""
    return max(10, rollout_workers, reward_workers)


def metrics_port(base: int, role: str, i: int, rollout_workers: int, reward_workers: int) -> int:
    """The /metrics port of ``role`` (worker ``i``) under ``job.metrics_port_base`` ``base`` (0: none).
    Blocks of ``metrics_port_block`` ports: rollout-i at base+i, reward-i at base+B+i, the trainer at
    base+2B, eval at base+3B; with up to 10 workers of each kind B = 10 (9100, 9110, 9120, 9130 for
    base 9100), and no two roles ever share a port whatever the counts."""
    if not base:
        return 0
    block = metrics_port_block(rollout_workers, reward_workers)
    return base + {"rollout": 0, "reward": block, "trainer": 2 * block, "eval": 3 * block}[role] + i


def role_config(cfg, run_dir: Path, name: str, settings: dict[str, Any]) -> Path:
    """Write the config of one role process, ``cfg`` with its own ``settings`` (dotted key -> value:
    worker id, static membership, Prometheus port) applied, to ``<run_dir>/roles/<name>.toml``."""
    path = Path(run_dir) / "roles" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(with_settings(cfg, settings)))
    return path


STANDBY = "trainer-standby"
"""The role name of the hot-standby trainer (``job.trainer_standby``)."""
ROLLOUT_SPARE = "rollout-spare"
"""The role name of the warm spare rollout worker (``job.rollout_standby``)."""


def standard_roles(
    cfg,
    rollout_workers: int,
    reward_workers: int,
    metrics_port_base: int = 0,
    trainer_standby: bool = False,
    rollout_standby: bool = False,
) -> list[RoleSpec]:
    """feed, trainer, reward-i, rollout-i; with ``metrics_port_base`` Prometheus ports (``metrics_port``).
    ``trainer_standby``: a second trainer process, ``trainer-standby``; both run with
    ``trainer.standby``, so whichever holds the checkpoint dir trains and the other waits to take
    over (a restarted trainer becomes the standby). Only the active one serves the metrics port.
    ``rollout_standby``: rollout workers by slot (``rollout.slots``, static members) and a warm
    spare, ``rollout-spare``, that takes the slot of a worker that dies (``producers.slots``; the
    spare serves no metrics port). A supervised stage (``feed.mode = "sft"``) has no rollout or
    reward workers: the feed writes the demonstrations to rl.scored."""

    def port(role: str, i: int = 0) -> int:
        return metrics_port(metrics_port_base, role, i, rollout_workers, reward_workers)

    standby = {"trainer.standby": True} if trainer_standby else {}
    roles = [
        RoleSpec("feed", "feed", may_exit=True),
        RoleSpec("trainer", "train", dict(standby), may_exit=True, metrics_port=port("trainer")),
    ]
    if trainer_standby:
        roles.append(RoleSpec(STANDBY, "train", dict(standby), may_exit=True, metrics_port=port("trainer")))
    if cfg.feed.mode == "sft":  # a supervised stage: the feed writes demonstrations to rl.scored itself
        return roles
    roles += [
        # a stable worker id (hence transactional id) and static membership: a restarted reward worker
        # fences its dead predecessor's transaction at once and gets its partitions back without a rebalance
        RoleSpec(
            f"reward-{i}",
            "reward",
            {"reward.worker_id": f"reward-{i}", "reward.group_instance_id": f"reward-{i}"},
            metrics_port=port("reward", i),
        )
        for i in range(reward_workers)
    ]
    slots = {"rollout.slots": rollout_workers} if rollout_standby else {}
    roles += [
        RoleSpec(
            f"rollout-{i}", "rollout", {"rollout.worker_id": f"rollout-{i}", **slots}, metrics_port=port("rollout", i)
        )
        for i in range(rollout_workers)
    ]
    if rollout_standby:
        roles.append(RoleSpec(ROLLOUT_SPARE, "rollout", {"rollout.worker_id": ROLLOUT_SPARE, **slots}))
    return roles


def hung_roles(
    workers: dict, worker_of: dict[str, str], started: dict[str, float], now: float, hang_after_s: float
) -> list[tuple[str, float]]:
    """(role, seconds since its last MetricEvent) of each live role that is hung: its MetricEvents
    stopped, after the first of its current process, while other roles' went on arriving for
    ``hang_after_s``. While nobody's arrive (the brokers are away: a restart under load took 80 s)
    the silence says nothing about the role, so it is not hung. ``workers``: the newest MetricEvent
    per "role/worker_id" key; ``worker_of``: worker id -> role name; ``started``: role name -> wall
    time its live process started (roles not in it are not alive). A trainer inside a long step
    keeps sending in-step progress events (``consumers.trainer.heartbeat``), so it is not hung."""
    newest = max((ev["timestamp_ms"] / 1000 for ev in workers.values()), default=0.0)
    out = []
    for key, ev in workers.items():
        name = worker_of.get(key.split("/", 1)[1])
        if name is None or name not in started:
            continue
        last = ev["timestamp_ms"] / 1000
        silent = min(now, newest) - last  # how long the others went on while this one said nothing
        if last > started[name] and silent > hang_after_s:  # not while (re)starting: setup may be long
            out.append((name, now - last))
    return out


class Launcher:
    def __init__(
        self, cfg, run_dir: Path, roles: list[RoleSpec], *, title: str, live: bool, console,
        policy: RestartPolicy | None = None, forks: ForkServer | None = None, on_hold=None,
    ):  # fmt: skip
        self.cfg, self.run_dir, self.roles = cfg, Path(run_dir), list(roles)
        self.on_hold = on_hold
        """Called once the job's lease is held, before anything else (``rlstream run`` stores the
        job's settings there: ``rlstream.identity``)."""
        self.forks = forks
        self.title, self.live, self.console = title, live, console
        self.policy = policy or RestartPolicy()
        self.sup: Supervisor | None = None
        self.config_path: Path | None = None
        self.progress = Progress()
        self.stall = StallWatch(time.time(), cfg.liveness.stall_s)
        client_log_to(self.run_dir / "logs" / "kafka-clients.log")  # librdkafka's lines: not on the terminal
        self.lags: dict[str, int] = {}
        self.report: dict = {}
        self.t_start = time.monotonic()
        self.hang_after_s = 2 * cfg.liveness.watchdog_s + 30
        self.role_states = RoleStates(self.hang_after_s)
        """Says a live role that is stopped or silent (a fault it cannot say itself)."""
        self._last_tracked = 0.0
        self._worker_of = {self._worker_id(r): r.name for r in roles}
        self._trainer_done_at: float | None = None
        self._retired: list[str] = []
        self._trained_at: float | None = None
        """When a trainer process first finished its run (``_trained``)."""

    def _worker_id(self, r: RoleSpec) -> str:
        if r.command == "train":
            return self.cfg.trainer.trainer_id
        if r.command == "eval":
            return self.cfg.eval.worker_id
        return r.name

    # -- steps -----------------------------------------------------------------------------------
    def prepare(self) -> Path:
        """Topics, the model (built once, so workers do not all build it at once), the config file."""
        from pipeline.models import materialize

        ensure_topics(self.cfg)
        materialize(self.cfg.model)
        if not self.cfg.checkpoint_store:  # spelled out: a tool run with -c config.toml under another
            # RLSTREAM_RUN_DIR (env wins over the file) still finds the weights and the notice key
            self.cfg = with_settings(self.cfg, {"checkpoint_store": self.cfg.store})
        if not has_checkpoint(self.cfg):  # a fresh job signs its notices from the first: no reader sees
            ensure_key(self.cfg.store)  # it keyless (a resumed job of an older rlstream stays unsigned)
        path = self.run_dir / "config.toml"
        path.write_text(dump_toml(self.cfg))
        self.config_path = path
        return path

    def start_roles(self, sup: Supervisor, config_path: Path) -> None:
        # the roles the fork server forks first (the feed, the reward workers), while it still
        # imports the others' modules: the reward group forms before the first rollout is in
        for r in sorted(self.roles, key=lambda r: r.command not in FIRST_COMMANDS):
            self.start_role(sup, r, config_path)

    def start_role(self, sup: Supervisor, r: RoleSpec, config_path: Path) -> None:
        sup.start(r.name, [r.command, "--config", str(self.role_config(r, config_path))], may_exit=r.may_exit,
                  memory_limit_mb=self.cfg.job.memory_limit_mb.get(r.command))  # fmt: skip

    def role_config(self, r: RoleSpec, config_path: Path) -> Path:
        """The config file a role starts with: the run's, or with the role's own settings (and its
        Prometheus port) applied, ``<run dir>/roles/<name>.toml``; nothing is passed as a string
        for the role to parse again."""
        prom = {"rollout": "rollout", "reward": "reward", "train": "trainer", "eval": "eval"}
        own = {**r.settings, **({f"{prom[r.command]}.prometheus_port": r.metrics_port} if r.metrics_port else {})}
        return role_config(self.cfg, self.run_dir, r.name, own) if own else config_path

    def add_role(self, r: RoleSpec) -> None:
        """Start one more role in the running pipeline (watched for hangs like the others)."""
        self.roles.append(r)
        self._worker_of[self._worker_id(r)] = r.name
        self.start_role(self.sup, r, self.config_path)

    def run(self, tick=None) -> dict:
        """The whole run; returns the report (``status`` is ``ok``, ``interrupted`` or ``failed: ...``).
        ``tick``: called once per watch round; a string it returns ends the run with that status.
        First the job's lease (``rlstream.lease``): JobAlreadyRunning while another run of the job
        lives, before anything is written or started; the run fails if another run takes it over."""
        with JobLease(self.cfg, self.run_dir, role_pids=self._role_pids, say=self.console.print) as lease:
            self.report["run_id"] = lease.run_id
            if self.on_hold is not None:
                self.on_hold()
            return self._run(lease.guard(tick))

    def _role_pids(self) -> list[int]:
        return [c.proc.pid for c in list(self.sup.children.values())] if self.sup is not None else []

    def _run(self, tick=None) -> dict:
        if self.forks is None:  # (``rlstream run`` starts it sooner: ``job.launch``)
            self.forks = start_fork_server(self.cfg)  # imports while the topics and the model are prepared
        sup = self.sup = Supervisor(self.run_dir / "logs", role_env(), self.policy, forks=self.forks)
        try:
            config_path = self.prepare()
        except BaseException:
            sup.stop_all()
            raise
        self.console.print(
            f"run dir {self.run_dir}\ntopics  {self.cfg.topics.prefix}*  on {self.cfg.kafka.bootstrap_servers}\n"
            f"watch   rlstream -c {config_path} status --watch"
        )
        status, codes = "ok", {}
        metrics = Consumer(client_conf(self.cfg, "launcher", kind="consumer"))  # rl.metrics and rl.dlq
        metrics.assign([TopicPartition(self.cfg.topics.name("metrics"), 0, 0), *self._dlq_partitions(metrics)])
        lags_done = threading.Event()
        lags = threading.Thread(target=self._watch_lags, args=(lags_done,), name="lags", daemon=True)
        from rlstream.samples import TableSource  # the tracker's sample table, read from rl.scored

        self.tracker = Tracker(self.cfg.tracking, self.run_dir, self.title, samples=TableSource(self.cfg))
        targets = self._write_prometheus_targets()
        try:
            self.stall = StallWatch(time.time(), self.cfg.liveness.stall_s)
            self.start_roles(sup, config_path)
            lags.start()
            status = self.watch(sup, metrics, tick)
        finally:
            lags_done.set()
            codes = sup.stop_all(timeout=self.cfg.liveness.shutdown_timeout_s + 10)
            retired = {e["name"]: e["code"] for e in sup.events if e["event"] in ("stopped", "stop_timeout")
                       and e["name"] in self._retired}  # fmt: skip
            codes = {**retired, **codes}  # the roles stopped before the final evaluation too
            self._drain_metrics(metrics, 1.0)
            metrics.close()
            self.tracker.close()
            if targets is not None:
                targets.unlink(missing_ok=True)
            if lags.is_alive():
                lags.join(timeout=self.cfg.kafka.request_timeout_s)
        self.report.update(status=status, exit_codes=codes, restarts=self._restarts, restarts_total=sup.restarts_total,
                           dead_letters={f"{s}/{r}": {"count": d.count, "first_error": d.first}
                                         for (s, r), d in sorted(self.stall.dead.by_key.items())})  # fmt: skip
        return self.report

    def watch(self, sup: Supervisor, metrics: Consumer, tick=None) -> str:
        """Until the trainer finishes: fold metrics, restart dead or hung roles, show progress. Every
        call here is short (a broker outage must not delay a restart); lags come from a thread."""
        view = None
        if self.live:
            from rich.live import Live

            view = Live(self._render(), console=self.console, refresh_per_second=2)
            view.start()
        last_print = 0.0
        self._restarts: dict[str, int] = {}
        try:
            while True:
                self._drain_metrics(metrics, 0.5)
                finished = sup.check()
                self._check_hangs(sup)
                self._say_role_states(sup)
                self._restarts = sup.restarts()
                now = time.monotonic()
                if now - self._last_tracked > 10:
                    self.tracker.lags(dict(self.lags))
                    self._last_tracked = now
                if view:
                    view.update(self._render())
                elif now - last_print > 10:
                    self.console.print(self._line(), highlight=False, soft_wrap=True)
                    last_print = now
                trained = self._trained(sup, set(finished), now)
                if trained and self._final_eval_done(sup):
                    return "ok"
                if self._trained_at is None and (stalled := self.stall.verdict(time.time())):
                    say = f"[bold red]{escape(stalled)}[/]; stopping the job"
                    self.console.print(say, highlight=False, soft_wrap=True)
                    return f"failed: {stalled}"
                if tick is not None and (outcome := tick()):
                    return outcome
        except ChildDied as exc:
            self.console.print(f"[bold red]{exc.name} died[/] (exit {exc.code}); stopping. Its log:\n{exc.log_tail}")
            return f"failed: {exc.name} exited with code {exc.code}" + (
                " (crash loop)" if "restarts" in str(exc) else ""
            )
        except KeyboardInterrupt:
            self.console.print("interrupted; stopping everything")
            return "interrupted"
        finally:
            if view:
                view.stop()

    # -- helpers ---------------------------------------------------------------------------------
    def _trained(self, sup: Supervisor, finished: set[str], now: float) -> bool:
        """A trainer process finished its run. With a standby (``job.trainer_standby``) either may
        be the one; the other is then let end by itself (it takes the freed lock, sees the run done
        and exits 0) before the job stops, for at most ``liveness.shutdown_timeout_s``: a SIGTERM in
        the finisher's own teardown, after its signal handlers are gone, was an unclean stop."""
        names = [r.name for r in self.roles if r.command == "train"]
        if not finished & set(names):
            return False
        self._trained_at = self._trained_at or now
        ended = all(n in finished or not sup.alive(n) for n in names)
        return ended or now - self._trained_at > self.cfg.liveness.shutdown_timeout_s

    def _final_eval_done(self, sup: Supervisor) -> bool:
        """The trainer has finished: with an eval role, the run ends once it has evaluated the final
        version (its ``eval_final`` event). Meanwhile the roles that feed the trainer are stopped,
        so the evaluation has the machine; the wait is bounded by ``liveness.slow_op_s`` (the eval's
        own watchdog limit for one evaluation)."""
        evals = [r.name for r in self.roles if r.command == "eval"]
        final = self.progress.steps[-1]["version"] if self.progress.steps else 0  # the trainer's newest
        if not evals or not self.cfg.trainer.max_steps or (self.progress.final_eval or -1) >= final:
            return True  # (an earlier run's final evaluation, on the topic too, is of a lower version)
        now = time.monotonic()
        if self._trainer_done_at is None:
            self._trainer_done_at = now
            for r in self.roles:
                if r.command not in ("eval", "train"):
                    sup.retire(r.name, self.cfg.liveness.shutdown_timeout_s + 10, "trainer finished")
                    self._retired.append(r.name)
            self.console.print("trainer finished; waiting for the evaluation of the final version", highlight=False)
        if now - self._trainer_done_at > self.cfg.liveness.slow_op_s:
            self.console.print("[yellow]the final version was not evaluated in time; stopping[/]")
            return True
        return False

    def _dlq_partitions(self, consumer: Consumer) -> list[TopicPartition]:
        """Every partition of the DLQ topic, from its start (the view counts the job's dead letters)."""
        topic = self.cfg.topics.name("dlq")
        try:
            parts = consumer.partitions(topic, timeout=self.cfg.kafka.request_timeout_s)
        except Exception as exc:  # the display must not stop the run; the configured count is a floor
            log.warning("dlq partitions unknown, using the configured count %s", kv(topic=topic, error=exc))
            parts = range(self.cfg.topics.dlq.partitions)
        return [TopicPartition(topic, p, 0) for p in parts]

    def _drain_metrics(self, metrics: Consumer, timeout: float) -> None:
        """Fold what the follow consumer has: MetricEvents (progress, tracking) and DeadLetters."""
        dlq = self.cfg.topics.name("dlq")
        for m in metrics.consume(1000, timeout):
            if m.topic() == dlq:
                try:
                    self.stall.add_dead_letter(codec.decode_as(m.value(), "DeadLetter"))
                except DecodeError:
                    self.stall.dead.add_undecodable()
                continue
            try:
                ev = codec.decode_as(m.value(), "MetricEvent")
            except DecodeError:  # a foreign record on the metrics topic must not stop the run
                continue
            self.progress.add(ev)
            self.stall.add_metric(ev)
            self.tracker.add(ev)
        self._say_faults()

    def _say_faults(self) -> None:
        """One line per fault a worker says it waits on (a full disk, an unreachable store), when it
        begins and when it ends (``WorkerMetrics.set_fault``)."""
        for key, line in self.progress.to_say:
            name = self._worker_of.get(key.partition("/")[2], key)
            self.console.print(escape(f"{name}: {line}"), style="yellow", highlight=False, soft_wrap=True)
        self.progress.to_say.clear()

    def _write_prometheus_targets(self) -> Path | None:
        """Prometheus file-based discovery of this run's /metrics ports (infra/prometheus.yml reads
        ``<run_dir>/../prometheus/*.json``); removed when the run ends."""
        ported = [r for r in self.roles if r.metrics_port]
        if not ported:
            return None
        path = self.run_dir.parent / "prometheus" / f"{self.run_dir.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        groups = [
            {"targets": [f"127.0.0.1:{r.metrics_port}"], "labels": {"run": self.run_dir.name, "process": r.name}}
            for r in ported
        ]
        path.write_text(json.dumps(groups, indent=2))
        return path

    def _say_role_states(self, sup: Supervisor) -> None:
        """One line when a live role's process is stopped or its metrics go silent, one when it moves
        again (``rlstream.role_states``); both in the run's fault log."""
        now, mono = time.time(), time.monotonic()
        live = {name: c.proc.pid for name, c in sup.children.items() if sup.alive(name)}
        started = {name: now - (mono - sup.children[name].started_at) for name in live}
        quiet = dict(hung_roles(self.progress.workers, self._worker_of, started, now, self.role_states.quiet_s))
        for rec, line in self.role_states.check(live, quiet, now):
            if rec["end"] is None:
                self.progress.fault_log.append(rec)
            self.console.print(escape(f"{rec['worker']}: {line}"), style="yellow", highlight=False, soft_wrap=True)

    def _check_hangs(self, sup: Supervisor) -> None:
        """Kill and restart the roles ``hung_roles`` finds hung."""
        now, mono = time.time(), time.monotonic()
        started = {name: now - (mono - c.started_at) for name, c in sup.children.items() if sup.alive(name)}
        for name, silent_s in hung_roles(self.progress.workers, self._worker_of, started, now, self.hang_after_s):
            sup.declare_hung(name, f"no metrics for {silent_s:.0f} s")

    def _watch_lags(self, done: threading.Event) -> None:
        """Thread: refresh ``self.lags`` every 3 s (admin calls may block for their timeout while the
        broker is away; the watch loop must not)."""
        admin = Admin(client_conf(self.cfg, "launcher"), self.cfg.kafka.request_timeout_s)
        try:
            while not done.wait(3.0):
                if not self._refresh_lags(admin):  # a fresh client: seen to time out for good after a broker restart
                    admin.close()
                    admin = Admin(client_conf(self.cfg, "launcher"), self.cfg.kafka.request_timeout_s)
        finally:
            admin.close()

    def _refresh_lags(self, admin: Admin) -> bool:
        try:
            self.lags = stage_lags(admin, self.cfg)
        except Exception as exc:  # a display must survive a broker hiccup; the roles themselves are supervised
            log.warning("lag unavailable this round %s", kv(error=exc))
            return False
        return True

    def _render(self):
        elapsed = time.monotonic() - self.t_start
        return render(self.progress, self.lags, self.cfg.trainer.max_steps, self.cfg.rl.max_staleness, elapsed,
                      self.title, getattr(self, "_restarts", {}), dead_letters=self.stall.dead.summary(),
                      stalled=self.stall.stalled(time.time(), self.lags), busy=self.stall.busy(time.time()))  # fmt: skip

    def _line(self) -> str:
        """The plain progress line (console markup escaped: the title and messages are shown as they are)."""
        p, last = self.progress, (self.progress.steps[-1] if self.progress.steps else {})
        stalled, dead = self.stall.stalled(time.time(), self.lags), self.stall.dead.summary()
        return escape(
            f"[{self.title}] {time.monotonic() - self.t_start:5.0f}s step {last.get('step', 0)}/{self.cfg.trainer.max_steps} "
            f"reward(last10)={p.recent_reward() or 0:.3f} samples/s={p.throughput():.1f} lag={self.lags} "
            f"restarts={getattr(self, '_restarts', {}) or 0}"
            + (f" dead letters: {dead}" if dead else "")
            + (f" trainer: {busy}" if (busy := self.stall.busy(time.time())) else "")
            + (f" stalled: {'; '.join(stalled)}" if stalled else "")
        )

    def _export(self, r: dict) -> dict | None:
        """A job run that finished ok: its final and best versions as HF directories
        (``rlstream.export.export_run``); a failed export fails the run (said in one line)."""
        if r.get("status") != "ok":
            return None
        from rlstream.export import export_run

        try:
            return export_run(self.cfg, self.run_dir, lambda line: self.console.print(escape(line), soft_wrap=True))
        except (RlstreamError, OSError) as exc:
            r["status"] = f"failed: export: {type(exc).__name__}: {exc}"
            self.console.print(escape(f"export failed: {type(exc).__name__}: {exc}"), soft_wrap=True)
            return None

    def finish_report(self, extra: dict) -> dict:
        """Add the step log figures (and, for a job run that finished ok, ``job.export``: the final
        and best versions exported), write report.json and the plots; print the summary line."""
        steps_log = self.progress.steps
        rewarded = [s for s in steps_log if s["reward_mean"] is not None]  # not the all-stale steps
        r = self.report
        r.update(extra)
        if extra.get("job") and self.cfg.job.export:
            r["export"] = self._export(r)
        r.update(
            {
                "wall_time_s": round(time.monotonic() - self.t_start, 1),
                "steps_completed": steps_log[-1]["step"] if steps_log else 0,
                "reward_first10_mean": mean_reward(rewarded[:10]),
                "reward_last10_mean": mean_reward(rewarded[-10:]),
                "reward_curve": [
                    [s["step"], None if s["reward_mean"] is None else round(s["reward_mean"], 4)] for s in steps_log
                ],
                "staleness_histogram": self.progress.staleness(),
                "longest_pause_s": self.progress.longest_pauses(),
                "eval_curve": self.progress.eval_curve(),
                "tool_curve": self.progress.tool_curve(),
                "faults": self.progress.fault_log,
                "steps": steps_log,
            }
        )
        write_report(self.run_dir, r)
        plots = plot_report(self.run_dir, r)
        pause = r["longest_pause_s"]
        self.console.print(
            f"[bold]{escape(r['status'])}[/]: {r['steps_completed']} steps in {r['wall_time_s']} s; reward "
            f"{r['reward_first10_mean'] or 0:.3f} (first 10 steps) -> {r['reward_last10_mean'] or 0:.3f} "
            f"(last 10); longest pause after the first step: trainer {pause['trainer']} s, reward {pause['reward']} s, "
            f"rollout {pause['rollout']} s; "
            f"restarts {r.get('restarts_total', 0)}; report {self.run_dir / 'report.json'}; "
            f"plots {', '.join(p.name for p in plots)}",
            soft_wrap=True,
        )
        return r
