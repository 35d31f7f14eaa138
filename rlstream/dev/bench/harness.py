"""Shared machinery of ``rlstream bench``: the broker, one config per pipeline run, the roles as
supervised CLI subprocesses (as ``rlstream demo`` runs them), reading a run's topics back, optional
py-spy profiles of the workers, and the result files (JSON, docs tables).

A benchmark module builds typed settings (dotted key -> value), calls ``run_pipeline`` and analyses what the run
left in Kafka and in the trainer's steps log. Nothing here asserts a timing; it only measures.
It is not a cluster launcher: every process runs on this machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.log import kv

REPO = Path(__file__).resolve().parents[3]
"""The repository root (rlstream/dev/bench/harness.py is three levels down): examples/ live there."""


@dataclass
class BenchContext:
    """What every benchmark of one ``rlstream bench`` invocation shares."""

    out: Path
    """Run directory of this invocation (one subdirectory per benchmark)."""
    bootstrap: str
    base_config: Path | None
    """The user's config file (``--config``), if any; benchmark settings are layered over it."""
    base_sets: list[str]
    """The user's ``--set`` items, applied before the benchmark's own."""
    size: str
    """tiny (CI smoke) | full (the documented run)."""
    run_id: str
    say: object = print
    profile: bool = False
    """Record py-spy profiles of the worker processes (when py-spy is installed)."""
    extra: dict = field(default_factory=dict)
    broker_pid: int | None = None
    """The local broker started for this invocation (None: an external cluster), for CPU accounting."""


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds a process has used so far (None if it is gone or unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_since(pid: int | None, since: float | None) -> float:
    """CPU seconds process ``pid`` used since ``since`` (its ``cpu_seconds`` reading before); 0.0
    where either reading is missing (no local broker: an external cluster's CPU is not on this
    machine)."""
    now = cpu_seconds(pid)
    return now - since if since is not None and now is not None else 0.0


def cpu_children() -> float:
    """User + system CPU seconds of every child process of this one waited for so far (their own
    waited-for children included): ``getrusage(RUSAGE_CHILDREN)``."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def broker(bootstrap: str | None, say=print):
    """Yield ``(bootstrap, broker pid)``: the given address (pid None), else a local broker in a
    temporary directory, started here and stopped by its PID at the end."""
    if bootstrap:
        yield bootstrap, None
        return
    from rlstream.broker import LocalBroker
    from rlstream.config import BrokerConfig

    data = tempfile.mkdtemp(prefix="rlstream-bench-broker-")
    b = LocalBroker(BrokerConfig(port=0, data_dir=data, heap_mb=768))
    try:
        state = b.start(progress=say, owned=True)
        yield state["bootstrap"], state["pid"]
    finally:
        b.stop(progress=say)
        shutil.rmtree(data, ignore_errors=True)


def child_env() -> dict[str, str]:
    """Environment of the role processes: one BLAS thread each, no inherited RLSTREAM_* settings
    (everything is in the run's config file), unbuffered logs."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    return {k: v for k, v in env.items() if not k.startswith("RLSTREAM_") or k in ("RLSTREAM_HOME", "RLSTREAM_CACHE")}


def scratch_config(bootstrap: str, run_dir: str, settings: Mapping[str, Any]):
    """The config of a benchmark that drives one role in this process, on fresh topics (a random
    prefix), over ``settings`` (dotted key -> value)."""
    import uuid

    from rlstream.config import load_config

    base = {
        "kafka.bootstrap_servers": bootstrap,
        "topics.prefix": f"bench{uuid.uuid4().hex[:8]}.",
        "run_dir": run_dir,
        "log_level": "WARNING",
    }
    return load_config(None, [], environ={}, settings={**base, **settings})


def make_config(ctx: BenchContext, name: str, settings: Mapping[str, Any]):
    """Resolve the config of one pipeline run (fresh topics, consumer groups and run dir) and write
    it as TOML: the user's file < env < ``--set`` < the run's identity < the benchmark's ``settings``
    (dotted key -> value)."""
    from pipeline.config import dump_toml
    from pipeline.topology import RunIdentity
    from rlstream.config import load_config

    run_dir = (ctx.out / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    prefix = re.sub(r"[^A-Za-z0-9._-]", "-", f"bench-{ctx.run_id}-{name}.")
    own = {
        "kafka.bootstrap_servers": ctx.bootstrap,
        "run_dir": str(run_dir),
        "log_level": "INFO",
        **RunIdentity.of_prefix(prefix).settings(),  # topics, consumer groups, transactional ids
        **settings,
    }
    cfg = load_config(
        ctx.base_config,
        ctx.base_sets,
        environ={k: v for k, v in os.environ.items() if k != "RLSTREAM_CONFIG"},
        settings=own,
    )
    path = run_dir / "config.toml"
    path.write_text(dump_toml(cfg))
    return cfg, path


@dataclass
class RunResult:
    status: str
    wall_s: float
    exit_codes: dict
    loadavg: tuple[float, float]
    """1-minute load average before and after (other work on the machine shows up here)."""
    profiles: dict[str, str] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each role process (and ``broker``, when local) used from the start of the work
    (``work_started`` set, or the feed started) until just before it was stopped."""
    work_s: float = 0.0
    """Seconds of that accounting window."""


def run_pipeline(
    ctx: BenchContext,
    cfg,
    config_path: Path,
    rollout_workers: int,
    reward_workers: int,
    feed: bool = True,
    trainer: bool = True,
    timeout_s: float = 600,
    done=None,
    profile: list[str] | None = None,
    work_started=None,
) -> RunResult:
    """Run the roles of one pipeline as supervised ``rlstream`` subprocesses until the trainer exits
    (``trainer.max_steps``) or ``done()`` returns True; then stop everything (SIGTERM, then SIGKILL).
    ``work_started`` (a threading.Event a driver sets) marks where CPU accounting starts; without
    it, when the feed starts."""
    from pipeline.admin import ensure_topics
    from pipeline.models import materialize
    from rlstream.launcher import role_config
    from rlstream.supervisor import ChildDied, Supervisor

    ensure_topics(cfg)
    materialize(cfg.model)  # once, so the workers do not all build it at the same moment
    run_dir = Path(cfg.run_dir)
    base = ["--config", str(config_path)]
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    status, codes, spies = "ok", {}, {}
    with Supervisor(run_dir / "logs", child_env()) as sup:
        if trainer:
            sup.start("trainer", ["train", *base], may_exit=True)
        for i in range(reward_workers):
            own = role_config(cfg, run_dir, f"reward-{i}", {"reward.worker_id": f"reward-{i}"})
            sup.start(f"reward-{i}", ["reward", "--config", str(own)])
        for i in range(rollout_workers):
            own = role_config(cfg, run_dir, f"rollout-{i}", {"rollout.worker_id": f"rollout-{i}"})
            sup.start(f"rollout-{i}", ["rollout", "--config", str(own)])
        if profile and ctx.profile:
            spies = _start_profilers(sup, profile, run_dir)
        try:
            # Prompts flow only once every rollout worker holds partitions: no rebalance during the run.
            while rollout_workers and not group_stable(cfg, cfg.rollout.group_id, rollout_workers):
                sup.check()
                if time.monotonic() - t0 > 180:
                    raise TimeoutError("the rollout workers did not form a stable group in 180 s")
                time.sleep(0.25)
            cpu0, t_work = None, time.monotonic()
            if feed:
                cpu0 = _cpu_now(ctx, sup)
                sup.start("feed", ["feed", *base], may_exit=True)
            while True:
                if cpu0 is None and work_started is not None and work_started.is_set():
                    cpu0, t_work = _cpu_now(ctx, sup), time.monotonic()
                finished = sup.check()
                if ("trainer" in finished) if done is None else done():
                    break
                if time.monotonic() - t0 > timeout_s:
                    status = f"timeout after {timeout_s:.0f} s"
                    break
                time.sleep(0.25)
        except ChildDied as exc:
            status = f"failed: {exc.name} exited with code {exc.code}"
            ctx.say(f"[bench] {exc.name} died (exit {exc.code}); its log: {exc.log_tail[-2000:]}")
        except TimeoutError as exc:
            status = f"failed: {exc}"
        wall = time.monotonic() - t0
        cpu1, work_s = _cpu_now(ctx, sup), time.monotonic() - t_work
        cpu = {n: round(c - (cpu0 or {}).get(n, 0.0), 3) for n, c in cpu1.items()} if cpu0 is not None else {}
        codes = sup.stop_all(timeout=10)
    profiles = _stop_profilers(spies)
    loads = (round(load0, 2), round(os.getloadavg()[0], 2))
    return RunResult(status, round(wall, 2), codes, loads, profiles, cpu, round(work_s, 2))


def _cpu_now(ctx: BenchContext, sup) -> dict[str, float]:
    out = {n: c for n, ch in sup.children.items() if (c := cpu_seconds(ch.proc.pid)) is not None}
    if (b := cpu_seconds(ctx.broker_pid)) is not None:
        out["broker"] = b
    return out


def group_stable(cfg, group_id: str, members: int) -> bool:
    """True once ``group_id`` is Stable with ``members`` members, each holding partitions."""
    from pipeline.admin import Admin
    from pipeline.errors import RlstreamError
    from pipeline.kafka import client_conf

    try:
        state, n, assigned = Admin(client_conf(cfg, "bench"), 10).group_state(group_id)
    except RlstreamError:  # not created yet, or the coordinator is busy: ask again
        return False
    return state == "STABLE" and n == members and assigned == members


# ---- py-spy ------------------------------------------------------------------------------------
def py_spy() -> str | None:
    """The py-spy executable: on PATH, else beside this Python (a venv that is not activated)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def _start_profilers(sup, names: list[str], run_dir: Path) -> dict:
    exe = py_spy()
    if exe is None:
        return {}
    spies = {}
    for name in names:
        child = sup.children.get(name)
        if child is None:
            continue
        out = run_dir / f"profile-{name}.txt"
        argv = [
            exe,
            "record",
            "--pid",
            str(child.proc.pid),
            "-r",
            "100",
            "-f",
            "raw",
            "-o",
            str(out),
            "--nonblocking",
            "--idle",
        ]
        log = open(run_dir / "logs" / f"py-spy-{name}.log", "wb")
        spies[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), out)
    return spies


def _stop_profilers(spies: dict) -> dict[str, str]:
    """py-spy stops by itself when its target exits; wait for it to write the profile."""
    out = {}
    for name, (proc, path) in spies.items():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(10)
        if path.is_file():
            out[name] = str(path)
    return out


LOOPS = re.compile(r"(^|;)(Trainer|RolloutWorker|RewardWorker)\.run_once ")
KAFKA_FRAMES = ("pipeline/kafka/", "pipeline/codec.py", "pipeline/control.py", "confluent_kafka", "fastavro")


def summarize_profile(path: str | Path, rate_hz: float = 100.0, top: int = 10) -> dict:
    """What a worker's main loop spent CPU on, from a py-spy raw profile (on-CPU samples only, so
    waiting in a poll or a sleep is not counted). Start-up (imports, model load) is excluded: only
    stacks inside ``Trainer.run_once``/``RolloutWorker.run_once``/``RewardWorker.run_once`` (the
    loop body under ``pipeline.worker``) count.

    Phases by frame: ``kafka+avro`` (``pipeline/kafka/``, ``codec.py``, ``control.py``,
    confluent_kafka, fastavro), ``engine`` (``engines/``), ``batching`` (``consumers/trainer/batch.py``)
    and ``other``. Seconds are samples / ``rate_hz``."""
    phases = {"kafka+avro": 0, "engine": 0, "batching": 0, "other": 0}
    leaves: dict[str, int] = {}
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or not LOOPS.search(stack):
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        if any(k in f for f in frames for k in KAFKA_FRAMES):
            phases["kafka+avro"] += n
        elif any("engines/" in f for f in frames):
            phases["engine"] += n
        elif any("consumers/trainer/batch.py" in f or "consumers/trainer/collate.py" in f for f in frames):
            phases["batching"] += n
        else:
            phases["other"] += n
        leaf = frames[-1] or frames[-2]
        leaves[leaf] = leaves.get(leaf, 0) + n
    hot = sorted(leaves.items(), key=lambda x: -x[1])[:top]
    return {
        "loop_cpu_s": round(total / rate_hz, 2),
        "phase_cpu_s": {k: round(v / rate_hz, 2) for k, v in phases.items()},
        "phase_share": {k: round(v / total, 3) if total else 0.0 for k, v in phases.items()},
        "top_leaves": [[name, round(v / total, 3)] for name, v in hot] if total else [],
    }


# ---- reading a run back ------------------------------------------------------------------------
def read_topic(cfg, role: str, schema: str | None = None, timeout_s: float = 60) -> list[tuple[int, int, int, dict]]:
    """Every committed record of a topic as ``(broker timestamp ms, partition, offset, record)``."""
    from pipeline import codec
    from pipeline.errors import DecodeError
    from pipeline.kafka import Consumer, client_conf

    out: list[tuple[int, int, int, dict]] = []
    with Consumer(client_conf(cfg, "bench", kind="consumer")) as c:
        for m in c.read_to_end(cfg.topics.name(role), timeout=timeout_s, strict=False):
            try:
                rec = codec.decode(m.value(), schema)[1]
            except DecodeError:
                continue
            out.append((m.timestamp()[1], m.partition(), m.offset(), rec))
    return out


def metric_events(cfg) -> list[dict]:
    return [rec for _, _, _, rec in read_topic(cfg, "metrics", "MetricEvent")]


# ---- numbers and files -------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def rnd(x, nd: int = 3):
    """Round for JSON; None and non-finite values become None."""
    if x is None or not math.isfinite(float(x)):
        return None
    return round(float(x), nd)


CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
"""The CPU flags a results block names (those that change the models' speed)."""


def machine() -> dict:
    """The facts a results block states: CPUs, the CPU model and its ``CPU_FLAGS`` (from
    ``/proc/cpuinfo``; empty where there is none), load average, git revision, time."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "git": rev.stdout.strip() or None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def img_dir_of(docs: Path) -> Path:
    """The docs tree's ``img/`` directory: the nearest one above the page, else ``<page dir>/img``."""
    for d in [docs.parent, *docs.parent.parents]:
        if (d / "img").is_dir():
            return d / "img"
        if (d / ".git").exists():
            break
    return docs.parent / "img"


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def schedule(arms: list, seeds: list, repeats: int = 1) -> list[tuple]:
    """The run order of a benchmark that runs every arm once per seed and repeat, as ``(seed,
    repeat, arm)``: seed by seed, the arms' order alternating from one turn to the next, so a drift
    in the machine's load hits every arm alike."""
    turns = [(seed, r) for seed in seeds for r in range(repeats)]
    return [(seed, r, a) for i, (seed, r) in enumerate(turns) for a in (arms if i % 2 == 0 else arms[::-1])]


def resume(
    path: Path, plan: list, key: Callable[[dict], Hashable], done: Callable[[dict], bool], say=print
) -> tuple[list[dict], list]:
    """Continue the runs of an earlier invocation with the same ``--out``: the results file's
    completed runs (``done``) stay and ``plan`` (run keys in order) loses theirs; a failed or
    missing run is (re)run. Returns (the runs kept, the keys still to run)."""
    held = json.loads(path.read_text()) if path.is_file() else {}
    runs = [r for r in [*held.get("runs", []), *held.get("other_runs", [])] if done(r)]
    have = {key(r) for r in runs}
    todo = [k for k in plan if k not in have]
    if runs:
        say(f"[bench] {len(runs)} completed runs in {path}; {len(todo)} of {len(plan)} to run")
    return runs, todo


def in_plan(runs: list[dict], plan: list, key: Callable[[dict], Hashable]) -> tuple[list[dict], list[dict]]:
    """``runs`` split into those of ``plan``, in its order, and the others, which a results file
    keeps as ``other_runs`` for a later invocation (``resume``)."""
    order = {k: i for i, k in enumerate(plan)}
    mine = sorted((r for r in runs if key(r) in order), key=lambda r: order[key(r)])
    return mine, [r for r in runs if key(r) not in order]


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def update_docs(
    docs: Path, section: str, markdown: str, images: list[Path], marker: str = "bench", img_dir: Path | None = None
) -> None:
    """Replace the generated block ``<!-- <marker>:<section> -->`` … ``<!-- /<marker>:<section> -->`` of
    ``docs`` (appended if missing) and copy ``images`` to ``img_dir`` (default the docs tree's
    ``img/bench/``, ``img_dir_of``)."""
    docs = Path(docs)
    img_dir = Path(img_dir) if img_dir is not None else img_dir_of(docs) / "bench"
    img_dir.mkdir(parents=True, exist_ok=True)
    for img in images:
        shutil.copyfile(img, img_dir / img.name)
    begin, end = f"<!-- {marker}:{section} -->", f"<!-- /{marker}:{section} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = docs.read_text() if docs.is_file() else "# Benchmarks\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    docs.write_text(text)


def log_line(ctx: BenchContext, what: str, **fields) -> None:
    ctx.say(f"[bench] {what} {kv(**fields)}")


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed (then the
    benchmarks print their tables without plots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: Path) -> list[Path]:
    """Lay out, write (110 dpi) and close ``fig``; the benchmark result's list of plots."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 22: 2.074, 24: 2.064, 26: 2.056, 28: 2.048, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip
"""Two-sided 95 % quantiles of Student's t by degrees of freedom."""


def t95(df: float) -> float:
    """The 95 % t quantile at ``df`` degrees of freedom (the table's entry at or below it; 1.96 past 120)."""
    if df < 1:
        return math.inf
    return T95[max(d for d in T95 if d <= df)] if df <= 120 else 1.96


def mean_ci(xs: list[float]) -> dict:
    """Mean, standard error and the 95 % t-interval of ``xs``, one value per run (seed); one value
    gives no interval."""
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "se": None, "lo": None, "hi": None}
    m = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(n) if n > 1 else None
    half = t95(n - 1) * se if se is not None else None
    return {
        "n": n,
        "mean": m,
        "se": se,
        "lo": None if half is None else m - half,
        "hi": None if half is None else m + half,
    }
