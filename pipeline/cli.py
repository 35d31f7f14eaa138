"""The ``rlstream`` command line. One subcommand per role; each parses the config, imports heavy
libraries only afterwards, and calls the role's ``run(config)``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pipeline.errors import RlstreamError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Asynchronous streaming RL post-training on Kafka.")
broker_app = typer.Typer(no_args_is_help=True, help="The local Kafka broker (no Docker needed).")
topics_app = typer.Typer(no_args_is_help=True, help="Create, describe and delete rlstream's topics.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the resolved configuration.")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
app.add_typer(config_app, name="config")
bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks (async vs sync, transport, weight notices, scaling); results as JSON + PNG, tables for the docs.",
)
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file.", show_default=False)]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override: section.key=value (repeatable).", show_default=False)
]
_root: dict = {}


@app.callback()
def main(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """rlstream: rollout producers, reward and trainer consumers, joined by Kafka topics."""
    _root["config"], _root["set"] = config, list(set_ or [])


def load(config: Path | None = None, set_: list[str] | None = None):
    """Resolve the config from root and command options, and set up logging."""
    from pipeline.config import load_config
    from pipeline.log import setup_logging

    cfg = load_config(config or _root.get("config"), [*_root.get("set", []), *(set_ or [])])
    setup_logging(cfg.log_level)
    return cfg


def run_cli() -> None:
    """Console entry point: typed rlstream errors become one clear line and exit code 2."""
    try:
        app()
    except RlstreamError as exc:
        console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", highlight=False)
        sys.exit(2)


# ---- broker ---------------------------------------------------------------------------------
@broker_app.command("start")
def broker_start(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Start the local KRaft broker (downloads Kafka's jars with Maven on first use)."""
    from pipeline.broker import LocalBroker

    state = LocalBroker(load(config, set_).broker).start(progress=console.print)
    print(state["bootstrap"])


@broker_app.command("stop")
def broker_stop(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Stop the local broker by its recorded PID."""
    from pipeline.broker import LocalBroker

    LocalBroker(load(config, set_).broker).stop(progress=console.print)


@broker_app.command("status")
def broker_status(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the local broker's state as JSON; exit 1 if it is not running."""
    from pipeline.broker import LocalBroker

    state = LocalBroker(load(config, set_).broker).state()
    print(json.dumps(state or {"running": False}, indent=2))
    raise typer.Exit(0 if state else 1)


@broker_app.command("logs")
def broker_logs(lines: int = typer.Option(50, "--lines", "-n"), config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the end of the local broker's logs."""
    from pipeline.broker import LocalBroker

    print(LocalBroker(load(config, set_).broker).tail(lines), end="")


@app.command(
    "kafka-tool",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def kafka_tool(
    ctx: typer.Context,
    name: str = typer.Argument(
        help="consumer-groups | topics | console-consumer | get-offsets | transactions | log-dirs"
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run one of Kafka's own CLI tools against the configured cluster (no Kafka download needed).

    Example: rlstream kafka-tool consumer-groups --describe --group rlstream-reward
    """
    import subprocess

    from pipeline.broker import kafka_tool_argv
    from pipeline.kafka import resolve_bootstrap

    cfg = load(config, set_)
    args = list(ctx.args)
    if "--bootstrap-server" not in args:
        args = ["--bootstrap-server", resolve_bootstrap(cfg.kafka, cfg.broker), *args]
    raise typer.Exit(subprocess.run(kafka_tool_argv(name, args)).returncode)


# ---- topics ---------------------------------------------------------------------------------
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
    from pipeline.admin import Admin
    from pipeline.kafka import client_conf

    cfg = load(config, set_)
    names = [cfg.topics.name(r) for r in cfg.topics.specs()]
    infos = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s).describe(names, with_offsets=True)
    if json_out:
        print(
            json.dumps(
                {
                    n: {
                        "partitions": i.partitions,
                        "replication_factor": i.replication_factor,
                        "messages": i.messages,
                        "configs": {
                            k: i.configs.get(k) for k in ("retention.ms", "cleanup.policy", "max.message.bytes")
                        },
                    }
                    for n, i in infos.items()
                },
                indent=2,
            )
        )
        return
    t = Table("topic", "partitions", "rf", "messages", "retention.ms", "cleanup", "max.message.bytes")
    for n, i in infos.items():
        t.add_row(
            n,
            str(i.partitions),
            str(i.replication_factor),
            str(i.messages),
            i.configs.get("retention.ms", ""),
            i.configs.get("cleanup.policy", ""),
            i.configs.get("max.message.bytes", ""),
        )
    Console().print(t)


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


# ---- config ---------------------------------------------------------------------------------
@config_app.command("show")
def config_show(json_out: bool = typer.Option(False, "--json"), config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved configuration (defaults < file < RLSTREAM_* env < --set)."""
    from pipeline.config import dump_toml

    cfg = load(config, set_)
    print(cfg.model_dump_json(indent=2) if json_out else dump_toml(cfg), end="" if not json_out else "\n")


@app.command()
def status(
    json_out: bool = typer.Option(False, "--json", help="Print one snapshot as JSON."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until Ctrl-C."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between the two offset samples."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Where is the bottleneck? Lag per stage (records and versions), versions, throughput, DLQ."""
    from pipeline.status import StatusReader, render

    reader = StatusReader(load(config, set_))
    try:
        if json_out:
            print(json.dumps(reader.snapshot(interval), indent=2, default=str))
            return
        out = Console()
        if not watch:
            out.print(render(reader.snapshot(interval)))
            return
        from rich.live import Live

        with Live(render(reader.snapshot(interval)), console=out, refresh_per_second=1) as live:
            while True:
                live.update(render(reader.snapshot(interval)))
    except KeyboardInterrupt:
        pass
    finally:
        reader.close()


# ---- roles ----------------------------------------------------------------------------------
@app.command()
def feed(
    source: Annotated[Path | None, typer.Argument(help="JSONL/JSON, Parquet, or a saved HF dataset dir.")] = None,
    epochs: int | None = typer.Option(None, "--epochs", help="Passes over the dataset (feed.epochs)."),
    rate: float | None = typer.Option(None, "--rate", help="Most groups per second, 0 = no limit (feed.rate)."),
    replicate: int | None = typer.Option(None, "--replicate", help="Messages per group (feed.replicate)."),
    limit: int | None = typer.Option(None, "--limit", help="Stop after this many groups (feed.limit)."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Publish prompts to the prompts topic (group_seq 0, 1, 2, ... across epochs); resumes where it stopped."""
    opts = {"source": source, "epochs": epochs, "rate": rate, "replicate": replicate, "limit": limit}
    cfg = load(config, [*(set_ or []), *(f"feed.{k}={v}" for k, v in opts.items() if v is not None)])
    from producers.feed import run

    run(cfg)


@app.command()
def rollout(
    engine: str | None = typer.Option(None, "--engine", help="hf | vllm | openai (sets rollout.engine.type)."),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run a rollout worker: generate every prompt it is given and publish the trajectories (one group member)."""
    cfg = load(config, [*([f"rollout.engine.type={engine}"] if engine else []), *(set_ or [])])
    from pipeline.config import write_resolved
    from producers.rollout import run

    write_resolved(cfg, f"rollout-{cfg.rollout.worker_id or 'worker'}")
    run(cfg)


@app.command()
def reward(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Run a reward worker: score rollouts into the scored topic exactly once (one consumer-group member)."""
    cfg = load(config, set_)
    from consumers.reward.worker import run

    run(cfg)


@app.command()
def train(
    engine: str | None = typer.Option(None, "--engine", help="torch | deepspeed (sets trainer.engine.type)."),
    max_steps: int | None = typer.Option(
        None, "--max-steps", help="Stop at this trainer step (default trainer.max_steps)."
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run the trainer: consume scored groups, train, publish versioned weights (resumes from its checkpoint)."""
    cfg = load(config, [*(set_ or []), *([f"trainer.engine.type={engine}"] if engine else [])])
    from consumers.trainer.worker import run

    run(cfg, max_steps=max_steps)


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
    """Run the end-to-end demo on the embedded default (local broker, tiny model, toy task)."""
    from pipeline.demo import run

    report = run(
        load(config, set_),
        steps,
        rollout_workers,
        reward_workers,
        max_staleness,
        model_path,
        engine,
        live=False if no_live else None,
        keep_broker=keep_broker,
        metrics_port_base=metrics_port_base,
        topic_prefix=topic_prefix,
    )
    raise typer.Exit(0 if report["status"] == "ok" else 1)


# ---- bench ----------------------------------------------------------------------------------
SizeOpt = Annotated[str, typer.Option("--size", help="tiny (CI smoke test) | full (the documented run).")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Run directory (default <run_dir>/bench-<id>).")]
DocsOpt = Annotated[
    Path | None, typer.Option("--docs", help="Update the generated tables of this markdown file (docs/benchmarks.md).")
]
BootstrapOpt = Annotated[
    str | None, typer.Option("--bootstrap", help="Kafka to use (default kafka.bootstrap_servers, else a local broker).")
]
ProfileOpt = Annotated[bool, typer.Option("--profile", help="Record py-spy profiles of the worker processes.")]


def _bench(names, size, out, docs, bootstrap, profile, config, set_, engines=None) -> None:
    if size not in ("tiny", "full"):
        raise typer.BadParameter("--size must be tiny or full")
    try:
        import bench.main  # noqa: F401
    except ModuleNotFoundError:  # an installed console script: the benchmarks live in the source tree
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import os

    from bench.main import run

    cfg = load(config, set_)
    path = config or _root.get("config") or os.environ.get("RLSTREAM_CONFIG")
    sets = [*_root.get("set", []), *(set_ or [])]
    run(names, cfg, path, sets, size, out, docs, bootstrap, profile, engines, say=console.print)


@bench_app.command("async")
def bench_async(
    size: SizeOpt = "full",
    engine: str = typer.Option("sim,hf", "--engine", help="Comma list of sim (load generator) and hf (tiny model)."),
    out: OutOpt = None,
    docs: DocsOpt = None,
    bootstrap: BootstrapOpt = None,
    profile: ProfileOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Async vs sync: samples/s for k in {0, 1, 2, 4}, idle fractions, stale drops, speedup, achieved/ideal."""
    _bench(["async"], size, out, docs, bootstrap, profile, config, set_, engine.split(","))


@bench_app.command("transport")
def bench_transport(
    size: SizeOpt = "full",
    out: OutOpt = None,
    docs: DocsOpt = None,
    bootstrap: BootstrapOpt = None,
    profile: ProfileOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Transport overhead: trajectories/s and MB/s through reward and trainer vs raw confluent-kafka."""
    _bench(["transport"], size, out, docs, bootstrap, profile, config, set_)


@bench_app.command("weights")
def bench_weights(
    size: SizeOpt = "full",
    out: OutOpt = None,
    docs: DocsOpt = None,
    bootstrap: BootstrapOpt = None,
    profile: ProfileOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Weight-notice latency: publish -> every rollout worker loaded (p50/p99), load time by checkpoint size."""
    _bench(["weights"], size, out, docs, bootstrap, profile, config, set_)


@bench_app.command("scaling")
def bench_scaling(
    size: SizeOpt = "full",
    out: OutOpt = None,
    docs: DocsOpt = None,
    bootstrap: BootstrapOpt = None,
    profile: ProfileOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Reward-stage throughput with 1, 2 and 4 workers (trivial reward)."""
    _bench(["scaling"], size, out, docs, bootstrap, profile, config, set_)


@bench_app.command("all")
def bench_all(
    size: SizeOpt = "full",
    out: OutOpt = None,
    docs: DocsOpt = None,
    bootstrap: BootstrapOpt = None,
    profile: ProfileOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Every benchmark in one run directory (one broker)."""
    _bench(["async", "transport", "weights", "scaling"], size, out, docs, bootstrap, profile, config, set_)


if __name__ == "__main__":
    run_cli()
