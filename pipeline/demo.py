"""``rlstream demo``: the whole pipeline on one machine, as a new user first meets it.

It starts the local broker (unless ``kafka.bootstrap_servers`` names one), creates a fresh set of
topics for the run, writes a toy verifiable task, and runs the feed, N rollout workers, M reward
workers and the trainer as separate supervised processes. It shows live progress, stops after
``--steps`` trainer steps, stops everything it started (by PID), and writes a run directory with
``report.json`` and PNG plots.

The toy task ("next digit"): the prompt is a digit and ``>``, e.g. ``7>``; the answer is the next
digit mod 10 (``8``). The reward is 1 when the response starts with it (built-in ``exact_match``
on the first character). A random-init character-level model starts near 1/18 and learns the
mapping by RL alone in about a hundred steps. ``--model-path`` and ``--engine`` run the same
pipeline with a real model and engine; ``--config`` can replace the task entirely.

It is not a production launcher: every role here runs on this machine.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from pipeline.log import kv

TASK = "next_digit"
CHARSET = "0123456789+=>? "


def write_task(path: Path, seed: int = 0) -> Path:
    """The 10 prompts of the next-digit task as JSONL (the feed cycles over them in epochs)."""
    rng = random.Random(seed)
    digits = list(range(10))
    rng.shuffle(digits)
    with open(path, "w") as f:
        for d in digits:
            f.write(
                json.dumps({"id": f"d{d}", "prompt": f"{d}>", "task": TASK, "reference": {"answer": str((d + 1) % 10)}})
                + "\n"
            )
    return path


def demo_overrides(
    run_dir: Path, prefix: str, bootstrap: str, steps: int, k: int | None, model_path: str | None, engine: str | None
) -> list[str]:
    """The demo's settings, as ``--set`` items layered over the user's config."""
    sets = [
        f"kafka.bootstrap_servers={bootstrap}",
        f"topics.prefix={prefix}",
        f"run_dir={json.dumps(str(run_dir))}",
        "topics.prompts.partitions=4",
        "topics.rollouts.partitions=4",
        "topics.scored.partitions=2",
        "rl.group_size=8",
        "rl.groups_per_step=8",
        f"feed.source={json.dumps(str(run_dir / 'task.jsonl'))}",
        "feed.epochs=100000",
        "feed.shuffle_seed=0",
        f"feed.limit={steps * 8 + 200}",
        "rollout.max_inflight=64",
        "rollout.max_new_tokens=2",
        "rollout.temperature=1.0",
        "reward.executor=thread",
        "reward.pool_size=1",
        "reward.max_batch_ms=50",
        "reward.metrics_interval_s=2",
        f'reward.tasks={{{TASK} = [{{name = "exact_match", kwargs = {{extract_regex = "^(.)"}}}}]}}',
        "trainer.lr=0.003",
        "trainer.micro_batch_size=64",
        "trainer.group_timeout_s=60",
        f"trainer.max_steps={steps}",
        "trainer.metrics_interval_s=2",
        "trainer.keep_weight_versions=3",
    ]
    if k is not None:
        sets.append(f"rl.max_staleness={k}")
    if model_path:
        sets += ['model.type="pretrained"', f"model.path={json.dumps(model_path)}"]
    else:
        sets += [
            f"model.charset={json.dumps(CHARSET)}",
            "model.hidden_size=64",
            "model.intermediate_size=128",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.max_position_embeddings=64",
        ]
    if engine:
        sets.append(f'rollout.engine={{type = "{engine}"}}')
    return sets


class Progress:
    """Folds rl.metrics into what the live view and the report need."""

    def __init__(self):
        self.steps: list[dict] = []
        self.workers: dict[str, dict] = {}

    def add(self, ev: dict) -> None:
        key = f"{ev['role']}/{ev['worker_id']}"
        self.workers[key] = ev
        m = ev["metrics"]
        if ev["role"] == "trainer" and "step" in m and "reward_mean" in m:
            step = int(m["step"])
            if self.steps and self.steps[-1]["step"] >= step:
                return  # periodic event repeating the last step's gauges
            t = ev["timestamp_ms"] / 1000
            samples = int(sum(v for k, v in m.items() if k.startswith("version_lag_")))
            prev_t = self.steps[-1]["time"] if self.steps else None
            self.steps.append(
                {
                    "step": step,
                    "version": ev["version"],
                    "time": t,
                    "reward_mean": m["reward_mean"],
                    "samples": samples,
                    "loss": m.get("loss"),
                    "staleness": {
                        k.removeprefix("version_lag_"): int(v) for k, v in m.items() if k.startswith("version_lag_")
                    },
                    "samples_per_s": samples / (t - prev_t) if prev_t and t > prev_t else 0.0,
                }
            )

    def recent_reward(self, n: int = 10) -> float | None:
        if not self.steps:
            return None
        tail = self.steps[-n:]
        return sum(s["reward_mean"] for s in tail) / len(tail)

    def throughput(self, n: int = 10) -> float:
        tail = self.steps[-n:]
        if len(tail) < 2 or tail[-1]["time"] <= tail[0]["time"]:
            return 0.0
        return sum(s["samples"] for s in tail[1:]) / (tail[-1]["time"] - tail[0]["time"])

    def staleness(self) -> dict[int, int]:
        from pipeline.report import staleness_histogram

        return staleness_histogram(self.steps)


def render(p: Progress, lags: dict, max_steps: int, k: int, elapsed: float):
    from rich.table import Table

    t = Table(title=f"rlstream demo — k = {k}, {elapsed:.0f} s", show_header=False, expand=False)
    last = p.steps[-1] if p.steps else None
    t.add_row(
        "trainer step / version", f"{last['step'] if last else 0} / {max_steps}   v{last['version'] if last else 0}"
    )
    r = p.recent_reward()
    t.add_row("mean reward (last 10 steps)", f"{r:.3f}" if r is not None else "-")
    t.add_row("samples/s (trainer, last 10 steps)", f"{p.throughput():.1f}")
    hist = p.staleness()
    t.add_row("staleness histogram", "  ".join(f"{d}: {n}" for d, n in hist.items()) or "-")
    t.add_row("lag (records) per stage", "  ".join(f"{s}: {n}" for s, n in lags.items()) or "-")
    versions = {k2.split("/", 1)[1]: ev["version"] for k2, ev in sorted(p.workers.items()) if ev["role"] == "rollout"}
    t.add_row("rollout loaded versions", "  ".join(f"{w}: v{v}" for w, v in versions.items()) or "-")
    return t


def run(
    cfg,
    steps: int = 150,
    rollout_workers: int = 2,
    reward_workers: int = 2,
    max_staleness: int | None = None,
    model_path: str | None = None,
    engine: str | None = None,
    live: bool | None = None,
    keep_broker: bool = False,
    metrics_port_base: int = 0,
    topic_prefix: str | None = None,
) -> dict:
    from rich.console import Console

    from pipeline.broker import LocalBroker

    console = Console(stderr=True)
    live = console.is_terminal if live is None else live
    run_id = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (Path(cfg.run_dir) / f"demo-{run_id}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    broker = None
    bootstrap = cfg.kafka.bootstrap_servers
    if not bootstrap:
        broker = LocalBroker(cfg.broker)
        started_here = broker.state() is None
        bootstrap = broker.start(progress=console.print)["bootstrap"]
        if not started_here:
            broker = None  # somebody else's broker: leave it running
    try:
        return _run(
            cfg,
            run_dir,
            run_id,
            bootstrap,
            steps,
            rollout_workers,
            reward_workers,
            max_staleness,
            model_path,
            engine,
            live,
            console,
            t_start,
            metrics_port_base,
            topic_prefix,
        )
    finally:
        if broker is not None and not keep_broker:
            broker.stop(progress=console.print)


def _run(
    cfg,
    run_dir,
    run_id,
    bootstrap,
    steps,
    rollout_workers,
    reward_workers,
    max_staleness,
    model_path,
    engine,
    live,
    console,
    t_start,
    metrics_port_base=0,
    topic_prefix=None,
) -> dict:
    from confluent_kafka import TopicPartition
    from rich.live import Live

    from pipeline import codec
    from pipeline.admin import Admin, ensure_topics
    from pipeline.config import dump_toml, load_config
    from pipeline.kafka import Consumer, client_conf
    from pipeline.models import materialize
    from pipeline.report import plot_report, write_report
    from pipeline.supervisor import ChildDied, Supervisor

    write_task(run_dir / "task.jsonl")
    sets = demo_overrides(
        run_dir, topic_prefix or f"demo-{run_id}.", bootstrap, steps, max_staleness, model_path, engine
    )
    dcfg = load_config(
        os.environ.get("RLSTREAM_CONFIG"),
        [*sets],
        environ={k: v for k, v in os.environ.items() if k != "RLSTREAM_CONFIG"},
    )
    (run_dir / "demo.toml").write_text(dump_toml(dcfg))
    ensure_topics(dcfg)
    console.print(f"run dir {run_dir}\ntopics  {dcfg.topics.prefix}*  on {bootstrap}")
    materialize(dcfg.model)  # once, so the workers do not all build it at the same moment
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    env = {k: v for k, v in env.items() if not k.startswith("RLSTREAM_") or k in ("RLSTREAM_HOME", "RLSTREAM_CACHE")}
    base = ["--config", str(run_dir / "demo.toml")]
    progress = Progress()
    k = dcfg.rl.max_staleness
    report: dict = {
        "metrics_ports": {}
        if not metrics_port_base
        else {
            **{f"rollout-{i}": metrics_port_base + i for i in range(rollout_workers)},
            **{f"reward-{i}": metrics_port_base + 10 + i for i in range(reward_workers)},
            "trainer": metrics_port_base + 20,
        },
        "run_dir": str(run_dir),
        "max_staleness": k,
        "steps_requested": steps,
        "bootstrap": bootstrap,
        "topic_prefix": dcfg.topics.prefix,
        "rollout_workers": rollout_workers,
        "reward_workers": reward_workers,
        "task": TASK if not os.environ.get("RLSTREAM_CONFIG") else "from config",
    }
    metrics = Consumer(client_conf(dcfg, "demo", kind="consumer"))
    metrics.assign([TopicPartition(dcfg.topics.name("metrics"), 0, 0)])
    admin = Admin(client_conf(dcfg, "demo"))
    lags: dict = {}
    status = "ok"
    with Supervisor(run_dir / "logs", env) as sup:
        sup.start("feed", ["feed", *base], may_exit=True)

        def port(offset: int) -> list[str]:  # Prometheus /metrics per role when --metrics-port-base is set
            return (
                []
                if not metrics_port_base
                else ["--set", f"{role_of[offset // 10]}.prometheus_port={metrics_port_base + offset}"]
            )

        role_of = {0: "rollout", 1: "reward", 2: "trainer"}
        sup.start("trainer", ["train", *base, *port(20)], may_exit=True)
        for i in range(reward_workers):
            sup.start(f"reward-{i}", ["reward", *base, "--set", f"reward.worker_id=reward-{i}", *port(10 + i)])
        for i in range(rollout_workers):
            sup.start(f"rollout-{i}", ["rollout", *base, "--set", f"rollout.worker_id=rollout-{i}", *port(i)])
        last_lag = 0.0
        view = Live(render(progress, lags, steps, k, 0), console=console, refresh_per_second=2) if live else None
        try:
            if view:
                view.start()
            last_print = 0.0
            while True:
                for m in metrics.consume(500, 0.5):
                    try:
                        progress.add(codec.decode_as(m.value(), "MetricEvent"))
                    except Exception:  # a foreign record on the metrics topic must not stop the demo
                        continue
                finished = sup.check()
                now = time.monotonic()
                if now - last_lag > 3:
                    try:
                        lags = {
                            s: sum(admin.lag(g, dcfg.topics.name(t)).values())
                            for s, g, t in (
                                ("rollout", dcfg.rollout.group_id, "prompts"),
                                ("reward", dcfg.reward.group_id, "rollouts"),
                                ("trainer", dcfg.trainer.group_id, "scored"),
                            )
                        }
                    except Exception as exc:  # a display must survive a broker hiccup (e.g. leader election)
                        console.print(f"[demo] lag unavailable this round: {exc}", highlight=False)
                    last_lag = now
                if view:
                    view.update(render(progress, lags, steps, k, now - t_start))
                elif now - last_print > 10:
                    last = progress.steps[-1] if progress.steps else {}
                    console.print(
                        f"[demo] {now - t_start:5.0f}s step {last.get('step', 0)}/{steps} "
                        f"reward(last10)={progress.recent_reward() or 0:.3f} samples/s={progress.throughput():.1f} "
                        f"lag={lags}",
                        highlight=False,
                    )
                    last_print = now
                if "trainer" in finished:
                    break
        except ChildDied as exc:
            status = f"failed: {exc.name} exited with code {exc.code}"
            console.print(
                f"[bold red]{exc.name} died[/] (exit {exc.code}); stopping the demo. Its log:\n{exc.log_tail}"
            )
        except KeyboardInterrupt:
            status = "interrupted"
            console.print("interrupted; stopping everything")
        finally:
            if view:
                view.stop()
            for m in metrics.consume(1000, 1.0):
                try:
                    progress.add(codec.decode_as(m.value(), "MetricEvent"))
                except Exception:
                    pass
            metrics.close()
            codes = sup.stop_all()
    steps_log = progress.steps
    first = [s["reward_mean"] for s in steps_log[:10]]
    last = [s["reward_mean"] for s in steps_log[-10:]]
    report.update(
        {
            "status": status,
            "wall_time_s": round(time.monotonic() - t_start, 1),
            "exit_codes": codes,
            "steps_completed": steps_log[-1]["step"] if steps_log else 0,
            "reward_first10_mean": sum(first) / len(first) if first else None,
            "reward_last10_mean": sum(last) / len(last) if last else None,
            "reward_curve": [[s["step"], round(s["reward_mean"], 4)] for s in steps_log],
            "staleness_histogram": progress.staleness(),
            "steps": steps_log,
            "title": f"next-digit task, k = {k}",
        }
    )
    write_report(run_dir, report)
    plots = plot_report(run_dir, report)
    console.print(
        f"[bold]{status}[/]: {report['steps_completed']} steps in {report['wall_time_s']} s; reward "
        f"{report['reward_first10_mean'] or 0:.3f} (first 10 steps) -> {report['reward_last10_mean'] or 0:.3f} "
        f"(last 10); report {run_dir / 'report.json'}; plots {', '.join(p.name for p in plots)}"
    )
    import logging

    logging.getLogger(__name__).info("demo done %s", kv(status=status, run_dir=run_dir))
    return report
