"""The dev tools' commands on the ``rlstream`` command line: ``rlstream chaos`` (the fault run and
its audit) and ``rlstream bench`` (the benchmarks). The command line registers them; their code is
imported only when they run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlstream.cli_common import ConfigOpt, SetOpt, console, load, sigterm_unwinds, sources
from rlstream.dev.bench.main import ALL, BENCHMARKS, LONG


def chaos(
    size: str = typer.Option(
        "tiny",
        "--size",
        help="tiny (CI, ~3-5 min) | full (the documented run, 20-40 min) | scale (100k samples: hours).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the fault schedule and the bad records."),
    out: Path | None = typer.Option(None, "--out", help="Run directory (default <run_dir>/chaos-<id>)."),
    bootstrap: str | None = typer.Option(None, "--bootstrap", help="Use this Kafka (then no broker restarts)."),
    groups: int | None = typer.Option(None, "--groups", help="Groups fed (a multiple of G and 10)."),
    duration: float | None = typer.Option(None, "--duration", help="Seconds of the chaos phase."),
    kills: int | None = typer.Option(None, "--kills", help="kill -9s in all (trainer and feed ones included)."),
    trainer_kills: int | None = typer.Option(None, "--trainer-kills"),
    feed_kills: int | None = typer.Option(None, "--feed-kills"),
    broker_restarts: int | None = typer.Option(
        None,
        "--broker-restarts",
        help="Broker faults (with --nodes > 1: nodes + 2 at least; 0: none, role kills only).",
    ),
    joins: int | None = typer.Option(None, "--joins", help="Join/leave cycles of a rollout and a reward worker."),
    fuzz: int | None = typer.Option(None, "--fuzz", help="Bad records injected."),
    partitions: int | None = typer.Option(
        None,
        "--partitions",
        min=0,
        help="Network partitions of a role from the broker, then healed (own single broker only).",
    ),
    net_latency: int | None = typer.Option(
        None, "--net-latency", min=0, help="Spells of added latency between a role and the broker."
    ),
    net_resets: int | None = typer.Option(
        None, "--net-resets", min=0, help="Resets (RST) of every connection of a role to the broker."
    ),
    storage_faults: int | None = typer.Option(
        None,
        "--storage-faults",
        min=0,
        help="Weights store faults: a full disk (a tmpfs store), a slow then failing store, published weights deleted.",
    ),
    stops: int | None = typer.Option(
        None, "--stops", min=0, help="SIGSTOPs of a role (every other one past its session timeout), then SIGCONT."
    ),
    ooms: int | None = typer.Option(
        None, "--ooms", min=0, help="Kills of a role by the kernel's OOM killer (a restart under a memory limit)."
    ),
    drain: float = typer.Option(600.0, "--drain-timeout", help="Longest wait for the trainer after the faults."),
    docs: Path | None = typer.Option(
        None,
        "--docs",
        help="A results page (e.g. docs/results/reliability.md) whose generated block of this size (between the "
        "markers chaos:SIZE and /chaos:SIZE) is rewritten from the run; its timeline picture goes to the docs' img/.",
    ),
    keep_data: bool = typer.Option(False, "--keep-data", help="Keep the broker's data in the run dir."),
    nodes: int | None = typer.Option(
        None,
        "--nodes",
        min=1,
        max=9,
        help="Brokers (default: the size's, 3 for scale, else 1): 3 runs a local cluster and hard-kills, pauses and rolls its nodes.",
    ),
    unpaced: bool = typer.Option(
        False, "--unpaced", help="Feed as fast as admission allows (availability runs: sim engines, ETTR)."
    ),
    standby: bool = typer.Option(
        False, "--standby", help="A hot-standby trainer (job.trainer_standby); trainer kills strike the active one."
    ),
    rollout_standby: bool = typer.Option(
        False,
        "--rollout-standby",
        help="Rollout workers by slot with a warm spare (job.rollout_standby); rollout kills strike the slot holders.",
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """A fault run: the real roles under kill -9, broker restarts, joins/leaves, bad records, network
    partitions and latency, storage faults, SIGSTOPs and OOM kills, then drained and audited from the
    topics. Prints the availability per fault class and one verdict line; exit 0 on PASS."""
    from rlstream.dev.chaos import ChaosOptions, run
    from rlstream.dev.chaos_plan import SIZES

    if size not in SIZES:
        raise typer.BadParameter(f"--size must be one of {', '.join(SIZES)}")
    if docs is not None and (docs.suffix != ".md" or not docs.is_file()):
        raise typer.BadParameter(f"--docs {docs}: not an existing markdown page (the run writes its block there)")

    sigterm_unwinds()
    opts = ChaosOptions(size, seed, out, bootstrap, groups, duration, kills, trainer_kills, feed_kills,
                        broker_restarts, joins, fuzz, drain, keep_data=keep_data, nodes=nodes, unpaced=unpaced, standby=standby,
                        rollout_standby=rollout_standby, docs=docs.resolve() if docs else None,
                        partitions=partitions, net_latency=net_latency, net_resets=net_resets,
                        storage_faults=storage_faults, stops=stops, ooms=ooms)  # fmt: skip
    raise typer.Exit(0 if run(*sources(config, set_), opts)["verdict"] == "PASS" else 1)


def check_rules(benchmarks: list[str], rules: list[str]) -> None:
    """``--rules`` names rows of the one benchmark that has them (barrier or async): BadParameter
    before anything starts, naming the rules there are."""
    from rlstream.dev.bench.async_sync import ROW_FAMILIES
    from rlstream.dev.bench.barrier import RULES

    known = {"barrier": list(RULES), "async": list(ROW_FAMILIES)}
    mine = [b for b in benchmarks if b in known]
    if len(mine) != 1 or len(benchmarks) != 1:
        raise typer.BadParameter("--rules applies to one benchmark run alone: barrier or async")
    bad = [r for r in rules if r not in known[mine[0]]]
    if bad:
        raise typer.BadParameter(f"--rules: {mine[0]} has no rule {bad}; its rules are {known[mine[0]]}")


def ks_option(benchmarks: list[str], ks: str) -> list[int]:
    """``--ks`` of ``bench learn``: the staleness bounds, or BadParameter before anything starts."""
    from rlstream.dev.bench.learn import ks_of

    if benchmarks != ["learn"]:
        raise typer.BadParameter("--ks applies to the learn benchmark run alone")
    try:
        return ks_of({"ks": [int(k) for k in ks.split(",") if k.strip()]}, {"ks": []})
    except ValueError as e:
        raise typer.BadParameter(f"--ks must be a comma list of integers >= 0, got {ks!r} ({e})") from None


def staleness_options(benchmarks: list[str], arms: str, task: str) -> dict:
    """``--arms``/``--task`` of ``bench staleness``: BadParameter before anything starts."""
    from rlstream.dev.bench.staleness import ARMS, TASKS

    if benchmarks != ["staleness"]:
        raise typer.BadParameter("--arms and --task apply to the staleness benchmark run alone")
    chosen = [a.strip() for a in arms.split(",") if a.strip()]
    bad = [a for a in chosen if a not in ARMS]
    if bad or task not in TASKS:
        what = f"--arms: no arm {bad}; the arms are {list(ARMS)}" if bad else f"--task: one of {list(TASKS)}"
        raise typer.BadParameter(what)
    return {"task": task, **({"arms": chosen} if chosen else {})}


def bench(
    names: Annotated[
        list[str],
        typer.Argument(help=f"Benchmarks: {', '.join(BENCHMARKS)}, or all (all but {', '.join(sorted(LONG))})."),
    ],
    size: str = typer.Option("full", "--size", help="tiny (CI smoke test) | full (the documented run)."),
    engine: str = typer.Option("sim,hf", "--engine", help="async: comma list of sim (load generator) and hf."),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Run directory (default <run_dir>/bench-<id>); learn, trl and staleness given the --out of an earlier "
        "invocation keep its completed runs and run the rest.",
    ),
    docs: Path | None = typer.Option(None, "--docs", help="Update the generated tables of this markdown file."),
    bootstrap: str | None = typer.Option(
        None, "--bootstrap", help="Kafka to use (default kafka.bootstrap_servers, else a local broker)."
    ),
    profile: bool = typer.Option(False, "--profile", help="Record py-spy profiles of the worker processes."),
    budget_s: float = typer.Option(
        0,
        "--budget-s",
        help="learn, barrier, trl: wall-clock budget of each run; peer: its time limit (0 = the size's).",
    ),
    seeds: str = typer.Option(
        "",
        "--seeds",
        help="barrier: comma list of seeds, one pair of runs each (default 0); "
        "learn, trl: comma list of seeds, one run of each arm per seed (default: the recipe's seeds); "
        "staleness: N (seeds 0..N-1) or a comma list (default: the size's, 20 at full).",
    ),
    ks: str = typer.Option(
        "", "--ks", help="learn: comma list of rl.max_staleness values to run (default: the size's, 0,1,2 at full)."
    ),
    arms: str = typer.Option("", "--arms", help="staleness: comma list of arms (default all; names in its table)."),
    task: str = typer.Option("next-digit", "--task", help="staleness: next-digit or arithmetic."),
    rules: str = typer.Option(
        "",
        "--rules",
        help="barrier: comma list of the rules to run (default: the size's; names in its table); "
        "async: which rows (default, token, overprovision; all by default).",
    ),
    against: Path | None = typer.Option(
        None,
        "--against",
        help="barrier: an earlier barrier.json whose runs of the other rules (same seeds) to pair with.",
    ),
    keep_data: bool = typer.Option(
        False,
        "--keep-data",
        help="learn, trl, barrier, staleness: keep each run's trainer checkpoints and published weights "
        "(by default removed once the run is summarised; its steps log, evals and logs stay).",
    ),
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Benchmarks (async vs sync, agentic, transport, weight notices, scaling, scheduling ceiling; by name: learn, barrier, trl, peer, trace); results as JSON + PNG, tables for the docs."""
    wanted = list(ALL) if "all" in names else names
    unknown = sorted(set(wanted) - set(BENCHMARKS))
    if unknown or size not in ("tiny", "full"):
        raise typer.BadParameter(f"unknown benchmark(s) {unknown}" if unknown else "--size must be tiny or full")
    try:
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--seeds must be a comma list of integers, got {seeds!r}") from None
    from rlstream.dev.bench.main import run

    sigterm_unwinds()
    path, sets = sources(config, set_)
    cfg = load(config, set_, resolve=False)
    extra = {**({"budget_s": budget_s} if budget_s else {}), **({"seeds": seed_list} if seed_list else {})}
    if ks:
        extra["ks"] = ks_option(wanted, ks)
    if rules:
        extra["rules"] = [r.strip() for r in rules.split(",") if r.strip()]
        check_rules(wanted, extra["rules"])
    if arms or task != "next-digit":
        extra.update(staleness_options(wanted, arms, task))
    if against is not None:
        if not against.is_file():
            raise typer.BadParameter(f"--against {against}: no such file (a barrier.json of an earlier run)")
        extra["against"] = str(against.resolve())
    if keep_data:
        extra["keep_data"] = True
    run(wanted, cfg, path, sets, size, out, docs, bootstrap, profile, engine.split(","), say=console.print,
        extra=extra or None)  # fmt: skip
