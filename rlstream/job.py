"""``rlstream run JOB.toml``: a whole job on one node, resumable by running the same command again.

A job file is the ordinary strict config plus a ``[job]`` section: its name, how many rollout and
reward workers, whether an ``rlstream eval`` process runs beside them, and optionally a built-in
dataset generator (``rlstream.tasks``). From the name come the job's fixed places: the topic prefix
``<name>.``, the consumer groups and transactional ids ``<name>-<role>``, and the run directory ``<run_dir>/<name>`` (resolved config, logs, report.json,
plots, TensorBoard, the trainer's checkpoints, generated data), unless the file sets them. So a
second ``rlstream run`` of the same file finds the same topics, the feed's state on rl.control and
the trainer's checkpoint, and goes on from there: no sample lost or trained twice (the roles'
guarantees, docs/results/reliability.md). Ctrl-C or SIGTERM stops every role cleanly; ``--steps`` raises the target.

``rlstream demo`` is this with a preset job (the next-digit task) and a fresh name per run.
What this is not: a cluster scheduler; for several machines run the roles yourself, or use the
Helm chart (docs/how-to/deploy.md).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.config import load_tree, merge, settings_tree, validate
from pipeline.errors import ConfigError
from pipeline.topology import RunIdentity


def _has(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def unset_only(tree: dict, settings: dict) -> dict:
    """The dotted ``settings`` the raw ``tree`` leaves unset, as a tree to merge."""
    return settings_tree({k: v for k, v in settings.items() if not _has(tree, k)})


def resolve(config_path, sets: list[str], preset: dict | None = None, name: str | None = None,
            flags: Mapping[str, Any] | None = None, bootstrap: str | None = None):  # fmt: skip
    """The job's config: ``preset`` < the job file < env < ``--set`` < ``flags`` (typed settings,
    dotted key -> value: a command's own flags), then the job's own
    places (topic prefix, consumer groups, transactional ids, run dir, generated data) where the
    layers left them unset. The generated data is written into the run dir (``plan`` writes nothing)."""
    cfg, data = plan(config_path, sets, preset, name, flags, bootstrap)
    write_data(data)
    return cfg


def plan(config_path, sets: list[str], preset: dict | None = None, name: str | None = None,
         flags: Mapping[str, Any] | None = None, bootstrap: str | None = None, model=None):  # fmt: skip
    """``resolve`` without writing anything: the config and the generated dataset's files (path ->
    text), which ``write_data`` writes once the checks before start (``rlstream.preflight``) passed,
    so a job refused by them leaves no run dir behind. ``model``: a function of the run dir giving
    the ``[model]`` table that replaces the layers' (a fork's base model)."""
    from rlstream.config import Config

    path = config_path or os.environ.get("RLSTREAM_CONFIG")
    tree = layers(path, sets, preset)
    merge(tree, settings_tree(flags, "flags"))
    job = tree.setdefault("job", {})
    job["name"] = name or job.get("name") or (Path(path).stem if path else "")
    if not job["name"]:
        raise ConfigError('a job needs a name: [job] name = "..." (or a job file, whose name is used)')
    base = Path(tree.get("run_dir", "runs"))
    tree["run_dir"] = str((base / job["name"]).resolve())
    if model is not None:
        tree["model"] = model(Path(tree["run_dir"]))
    # the job's topics, consumer groups and transactional ids (pipeline.topology), where unset: two
    # jobs on one cluster (or a demo run after another) never share a group, so neither waits out
    # the other's static members
    merge(tree, unset_only(tree, RunIdentity.of_job(job["name"]).settings()))
    if bootstrap:
        tree.setdefault("kafka", {})["bootstrap_servers"] = bootstrap
    cfg = validate(Config, tree)
    data: dict[Path, str] = {}
    if cfg.job.dataset is not None:
        data = generated_data(cfg, set_feed=not _has(tree, "feed.source"), set_eval=not _has(tree, "eval.source"))
    if cfg.job.eval and cfg.eval.source is None:
        raise ConfigError("job.eval = true needs eval.source (or job.dataset.held_out > 0)")
    return cfg, data


def layers(config_path, sets: list[str], preset: dict | None = None) -> dict:
    """The raw settings, before the job's own places: ``preset`` < the job file (else
    ``RLSTREAM_CONFIG``) < env < ``--set``. ``preset`` is not changed."""
    path = config_path or os.environ.get("RLSTREAM_CONFIG")
    return merge(copy.deepcopy(preset or {}), load_tree(path, sets, dict(os.environ)))


def generated_data(cfg, set_feed: bool, set_eval: bool) -> dict[Path, str]:
    """The job's generated dataset (train and held-out split) as files in its run dir, path -> text,
    not written yet (``write_data``); ``feed.source``/``eval.source`` point at them where unset."""
    from rlstream.tasks import GENERATORS

    d = cfg.job.dataset
    if d.generator not in GENERATORS:
        raise ConfigError(f"job.dataset.generator {d.generator!r}: built-ins are {', '.join(sorted(GENERATORS))}")
    try:
        records = GENERATORS[d.generator](**d.options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"job.dataset ({d.generator}): {exc}") from exc
    if isinstance(records, dict):  # the generator made its own held-out split (another seed)
        train, held = records["train"], records["eval"]
    else:
        cut = int(len(records) * d.held_out)  # the generator's order is seeded, so the split is stable
        train, held = records[cut:], records[:cut]
    data = Path(cfg.run_dir) / "data"
    files = {data / f"{d.generator}-{part}.jsonl": "".join(json.dumps(r) + "\n" for r in recs)
             for part, recs in (("train", train), ("eval", held))}  # fmt: skip
    if set_feed:
        cfg.feed.source = data / f"{d.generator}-train.jsonl"
    if set_eval and held:
        cfg.eval.source = data / f"{d.generator}-eval.jsonl"
    return files


def write_data(files: dict[Path, str]) -> None:
    """Write generated data files (``plan``), leaving a file with the same text untouched: a re-run
    keeps it as it is (the feed's resume checks the dataset's hash)."""
    for f, text in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        if not f.is_file() or hashlib.sha256(f.read_bytes()).digest() != hashlib.sha256(text.encode()).digest():
            f.write_text(text)


@contextlib.contextmanager
def kafka_for(cfg, keep_broker: bool, say):
    """The configured cluster, else the local broker (started here, and stopped at the end
    unless it was already running or ``keep_broker``)."""
    if cfg.kafka.bootstrap_servers:
        yield cfg.kafka.bootstrap_servers
        return
    from rlstream.broker_cluster import local_broker

    broker = local_broker(cfg.broker)
    started_here = broker.state() is None
    state = broker.start(progress=say, owned=not keep_broker)
    try:
        yield state["bootstrap"]
    finally:
        if started_here and not keep_broker:
            broker.stop(progress=say)


@contextlib.contextmanager
def connected(cfg, keep_broker: bool, say):
    """``kafka_for`` the job, checked: BrokerUnreachable (one line) when nothing answers there
    within ``liveness.broker_check_s``; ``cfg.kafka.bootstrap_servers`` is set to the address.
    ``rlstream run`` and every method of ``rlstream.Job`` reach Kafka this way."""
    from rlstream.config import require_broker

    with kafka_for(cfg, keep_broker, say) as bootstrap:
        require_broker(cfg, bootstrap)
        cfg.kafka.bootstrap_servers = bootstrap
        yield cfg


@contextlib.contextmanager
def checked_start(cfg, data: dict[Path, str], keep_broker: bool, say, *, restart: bool = False,
                  before_check=None, created=None):  # fmt: skip
    """A job run's start, in an order where a mistake creates nothing: ``check``, then the cluster
    (``kafka_for``: the local broker unless one is configured) and that a broker
    answers there (BrokerUnreachable, one line; a configured one is tried first, as the quickest
    check); with ``restart`` the job's topics, groups and files deleted (``rlstream.jobs.remove``);
    then the job's record compared (``rlstream.identity.check``: JobChanged, NothingToTrain, or the
    line ``resuming ...`` made, for ``run_job`` to say once the job is held), then the generated
    data written. Yields the job's stored record (None for a fresh job) and that line;
    ``cfg.kafka.bootstrap_servers`` is the address.
    ``before_check(cfg)``: called connected, before ``check`` (a fork exports its base model there);
    ``created``: a directory to delete again when the start fails after it."""
    from rlstream import identity
    from rlstream.config import require_broker
    from rlstream.preflight import check

    if cfg.kafka.bootstrap_servers:
        require_broker(cfg)
    if before_check is None:
        check(cfg, data)
    with connected(cfg, keep_broker, say):
        if restart:
            from rlstream.jobs import remove

            remove(cfg, say)
        try:
            if before_check is not None:
                before_check(cfg)
                check(cfg, data)
            stored = identity.read(cfg)
            line = identity.check(cfg, stored)
        except BaseException:
            if created is not None:  # a fork refused after its base was exported: nothing left behind
                import shutil

                shutil.rmtree(created, ignore_errors=True)
            raise
        write_data(data)
        yield stored, line


def lines(console):
    """A ``say`` that prints each message as one line (a refusal or a change list is not wrapped)."""
    from rich.markup import escape

    return lambda text: console.print(escape(text), highlight=False, soft_wrap=True)


def launch(job_file, sets: list[str], *, preset: dict | None = None, name: str | None = None,
           flags: Mapping[str, Any] | None = None, keep_broker: bool = False, live: bool | None = None,
           console=None, restart: bool = False, fork: str | None = None,
           from_version: int | None = None) -> dict:  # fmt: skip
    """``rlstream run`` (and ``rlstream.Job.run``): the job's config (``plan``: nothing written yet),
    the job file's directory for reward modules, the checks before start, the job's Kafka and its
    record compared (``checked_start``: a mistake is one line and creates nothing), then
    ``run_job``; returns the report. ``restart``: the job's topics, groups and files deleted first.
    ``fork``: run the new job ``fork`` instead, whose base model is version ``from_version``
    (default: the newest) of this one (``launch_fork``)."""
    from rich.console import Console

    from rlstream.cli_common import quiet_clients
    from rlstream.config import record_job_dir
    from rlstream.launcher import early_fork_server

    quiet_clients()  # the checks' and the job record's clients, before the launcher's own log
    console = console or Console(stderr=True)
    if fork is not None:
        if restart:
            raise ConfigError("--restart and --fork do not go together: fork first, then restart the fork if need be")
        return launch_fork(job_file, sets, fork, from_version, preset=preset, name=name, flags=flags,
                           keep_broker=keep_broker, live=live, console=console)  # fmt: skip
    if from_version is not None:
        raise ConfigError("--from-version goes with --fork NEW (the version of this job the new one starts from)")
    cfg, data = plan(job_file, sets, preset, name, flags)
    record_job_dir(cfg, job_file)
    with (
        early_fork_server(cfg) as forks,
        checked_start(cfg, data, keep_broker, lines(console), restart=restart) as (rec, line),
    ):
        return run_job(cfg, title=f"rlstream run {cfg.job.name}", live=live, console=console, forks=forks,
                       forked_from=(rec or {}).get("forked_from"), note=line)  # fmt: skip


def launch_fork(job_file, sets: list[str], new: str, from_version: int | None, *, preset=None, name=None,
                flags=None, keep_broker=False, live=None, console=None) -> dict:  # fmt: skip
    """``rlstream run JOB --fork NEW [--from-version N]``: the job NEW, with JOB's settings (its file
    and ``sets``) but its own topics and run dir, whose base model is version N of JOB exported into
    ``<NEW's run dir>/base`` (version 0: JOB's own base model). Run again, it resumes NEW."""
    from rlstream.config import record_job_dir
    from rlstream.launcher import early_fork_server

    parent, _ = plan(job_file, sets, preset, name, flags)
    if new == parent.job.name:
        raise ConfigError(f"--fork {new}: the fork needs a name of its own (this job is {new})")
    from_parent = from_version == 0
    parent_model = parent.model.model_dump(mode="json")

    def model(run_dir: Path) -> dict:
        return parent_model if from_parent else {"type": "pretrained", "path": str(run_dir / "base")}

    cfg, data = plan(job_file, sets, preset, new, flags, model=model)
    from consumers.trainer.state import trainer_root

    for what, mine, theirs in (("checkpoint_store", cfg.store, parent.store),
                               ("trainer.checkpoint_dir", trainer_root(cfg), trainer_root(parent))):  # fmt: skip
        if str(mine) == str(theirs):
            raise ConfigError(f"--fork {new}: {what} {mine} is {parent.job.name}'s too (the job file sets it): give the "
                              f"fork its own with -s {what}=...")  # fmt: skip
    record_job_dir(cfg, job_file)
    base = Path(cfg.run_dir) / "base"
    origin: dict = {}

    def export_base(connected_cfg) -> None:
        from rlstream import identity
        from rlstream.jobs import fork_model

        stored = identity.read(connected_cfg)
        if stored is not None:  # the fork exists: it resumes, from the version it was forked from
            was = stored.get("forked_from") or {}
            if from_version is not None and was.get("version") != from_version:
                raise ConfigError(
                    f"job {new} exists, forked from {was.get('job')} version {was.get('version')}: a fork from "
                    f"version {from_version} is another job: give it another name"
                )
            origin.update(was)
            return
        parent.kafka.bootstrap_servers = connected_cfg.kafka.bootstrap_servers
        prec = identity.read(parent)
        if prec is None:
            raise ConfigError(f"job {parent.job.name} has not run on {parent.kafka.bootstrap_servers}: nothing to fork")
        if str(prec["run_dir"]) != str(parent.run_dir):
            raise ConfigError(f"job {parent.job.name} lives in {prec['run_dir']}: fork it with -s run_dir="
                              f"{Path(prec['run_dir']).parent}")  # fmt: skip
        if from_parent:
            origin.update(job=parent.job.name, version=0, sha256="", run_dir=str(parent.run_dir))
        else:
            base.parent.mkdir(parents=True, exist_ok=True)
            origin.update(fork_model(parent, from_version, base, lines(console)))

    fresh = not Path(cfg.run_dir).exists()
    with early_fork_server(cfg) as forks, checked_start(cfg, data, keep_broker, lines(console), before_check=export_base,
                                                         created=Path(cfg.run_dir) if fresh else None) as (_, line):  # fmt: skip
        title = f"rlstream run {new} (forked from {origin['job']} v{origin['version']})"
        return run_job(cfg, title=title, live=live, console=console, forks=forks, forked_from=dict(origin),
                       note=line)  # fmt: skip


def run_job(
    cfg,
    *,
    title: str,
    live: bool | None = None,
    console=None,
    extra_report: dict | None = None,
    forks=None,
    forked_from: dict | None = None,
    note: str | None = None,
) -> dict:
    """Start the job's roles under the launcher until the trainer reaches ``trainer.max_steps``;
    returns the report (also in ``<run dir>/report.json``). ``forks``: a fork server started
    earlier (``rlstream.launcher.start_fork_server``), else the launcher starts one. Once the job's
    lease is held, its settings are stored (``rlstream.identity.write``; ``forked_from``: the
    parent of a fork, also in the report; ``note``: the line that says how the job goes on, said
    then)."""
    from rich.console import Console
    from rich.markup import escape

    from rlstream import identity
    from rlstream.launcher import Launcher, RoleSpec, metrics_port, standard_roles

    console = console or Console(stderr=True)
    j = cfg.job
    roles = standard_roles(
        cfg, j.rollout_workers, j.reward_workers, j.metrics_port_base, j.trainer_standby, j.rollout_standby
    )
    if j.eval:
        roles.append(
            RoleSpec(
                "eval",
                "eval",
                may_exit=False,
                metrics_port=metrics_port(j.metrics_port_base, "eval", 0, j.rollout_workers, j.reward_workers),
            )
        )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    live = console.is_terminal if live is None else live

    def held() -> None:  # the job is ours: say how it goes on, then record its settings
        if note:
            console.print(escape(note), highlight=False, soft_wrap=True)
        identity.write(cfg, forked_from)

    launcher = Launcher(cfg, run_dir, roles, title=title, live=live, console=console, forks=forks,
                        on_hold=held)  # fmt: skip
    launcher.run()
    return launcher.finish_report(
        {
            "job": j.name,
            "run_dir": str(run_dir),
            "max_staleness": cfg.rl.max_staleness,
            "steps_requested": cfg.trainer.max_steps,
            "bootstrap": cfg.kafka.bootstrap_servers,
            "topic_prefix": cfg.topics.prefix,
            "rollout_workers": 0 if cfg.feed.mode == "sft" else j.rollout_workers,  # an SFT job runs none
            "reward_workers": 0 if cfg.feed.mode == "sft" else j.reward_workers,
            "metrics_ports": {r.name: r.metrics_port for r in roles if r.metrics_port},
            "title": f"{j.name}, k = {cfg.rl.max_staleness}"
            + (f" (forked from {forked_from['job']} v{forked_from['version']})" if forked_from else ""),
            **({"forked_from": forked_from} if forked_from else {}),
            **(extra_report or {}),
        }
    )
