"""``rlstream demo``: the whole pipeline on one machine, as a new user first meets it.

It starts the local broker (unless ``kafka.bootstrap_servers`` names one), creates a fresh set of
topics for the run, writes a toy verifiable task, and runs the feed, N rollout workers, M reward
workers and the trainer as separate supervised processes: a preset of ``rlstream run``
(``rlstream.job``), named ``demo-<run id>`` so every demo starts fresh. It shows live progress,
restarts a role that dies, stops after ``--steps`` trainer steps, stops everything it started (by
PID), and writes a run directory with ``report.json``, PNG plots and TensorBoard files.

The toy task ("next digit"): the prompt is a digit and ``>``, e.g. ``7>``; the answer is the next
digit mod 10 (``8``). The reward is 1 when the response starts with it (built-in ``exact_match``
on the first character). A random-init character-level model starts near 1/18 and learns the
mapping by RL alone in about a hundred steps.

Settings, later ones win: the demo's own < ``--config`` file < ``RLSTREAM_*`` env < ``--set`` <
the demo's flags (``--steps``, ``-k``, ``--model-path``, ``--engine``, ``--topic-prefix``) <
the run's own (run dir, bootstrap). So a config file can replace the task, model or rewards.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import load_tree, settings_tree
from rlstream.config import record_job_dir

TASK = "next_digit"
CHARSET = "0123456789+=>? "
DEMO_MODEL = {
    "charset": CHARSET,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 2,
    "max_position_embeddings": 64,
}
"""The demo's model (``model.type = "tiny"``), the one owner of its shape: examples/next-digit.toml,
infra/compose/job.toml and the Helm values repeat it (tests/test_demo_model.py checks they agree).
Head size 64 / 2 = 32: vLLM's CPU attention kernels take head sizes 32, 64, 96, ..., 256 (and 80,
112) only, so ``--engine vllm`` runs it on a CPU too (with 4 heads of 16 it refused)."""


@dataclass
class DemoOptions:
    steps: int = 150
    k: int | None = None
    rollout_workers: int = 2
    reward_workers: int = 2
    model_path: str | None = None
    engine: str | None = None
    live: bool | None = None
    keep_broker: bool = False
    metrics_port_base: int = 0
    topic_prefix: str | None = None


def write_task(path: Path, seed: int = 0) -> Path:
    """The 10 prompts of the next-digit task as JSONL (the feed cycles over them in epochs)."""
    from rlstream.tasks import next_digit

    path.write_text("".join(json.dumps(rec) + "\n" for rec in next_digit(seed)))
    return path


def demo_settings(run_dir: Path, run_id: str) -> dict[str, Any]:
    """The demo's own settings (the lowest layer), dotted key -> value
    (``pipeline.config.settings_tree``)."""
    return {
        "topics.prefix": f"demo-{run_id}.",
        "topics.prompts.partitions": 4,
        "topics.rollouts.partitions": 4,
        "topics.scored.partitions": 2,
        "rl.group_size": 8,
        "rl.groups_per_step": 8,
        "feed.source": str(run_dir / "task.jsonl"),
        "feed.epochs": 100000,
        "feed.shuffle_seed": 0,
        "rollout.max_inflight": 64,
        "rollout.max_new_tokens": 2,
        "rollout.temperature": 1.0,
        "reward.executor": "thread",
        "reward.pool_size": 1,
        "reward.max_batch_ms": 50,
        "reward.metrics_interval_s": 2,
        "reward.tasks": {TASK: [{"name": "exact_match", "kwargs": {"extract_regex": "^(.)"}}]},
        "trainer.lr": 0.003,
        "trainer.micro_batch_size": 64,
        "trainer.group_timeout_s": 60,
        "trainer.metrics_interval_s": 2,
        "trainer.keep_weight_versions": 3,
        **model_settings(),
    }


def model_settings() -> dict[str, Any]:
    """``DEMO_MODEL`` as settings, dotted key -> value."""
    return {f"model.{k}": v for k, v in DEMO_MODEL.items()}


def flag_settings(opts: DemoOptions) -> dict[str, Any]:
    """What the demo's command-line flags set (they win over the config file and --set)."""
    settings: dict[str, Any] = {"trainer.max_steps": opts.steps}
    if opts.k is not None:
        settings["rl.max_staleness"] = opts.k
    if opts.model_path:
        settings["model"] = {"type": "pretrained", "path": opts.model_path}
    if opts.engine:
        settings["rollout.engine"] = {"type": opts.engine}
    if opts.topic_prefix:
        settings["topics.prefix"] = opts.topic_prefix
    return settings


def resolve(config_path, sets, opts: DemoOptions, run_id: str, bootstrap: str | None = None):
    """The demo run's config: the demo's settings < the file < env < --set < the demo's flags, as a
    job named ``demo-<run id>`` (fresh topics and run dir each time) with the next-digit data."""
    from rlstream.job import write_data

    cfg, data = plan(config_path, sets, opts, run_id, bootstrap)
    write_data(data)
    return cfg


def plan(config_path, sets, opts: DemoOptions, run_id: str, bootstrap: str | None = None):
    """``resolve`` without writing anything: the config and its generated data (``rlstream.job.plan``)."""
    from rlstream.job import plan as plan_job

    own = demo_settings(Path("."), run_id)
    preset = settings_tree({k: v for k, v in own.items() if k not in ("feed.source", "topics.prefix")})
    preset["job"] = {"dataset": {"generator": "next_digit"}}
    flags = {
        **flag_settings(opts),
        "job.rollout_workers": opts.rollout_workers,
        "job.reward_workers": opts.reward_workers,
        "job.metrics_port_base": opts.metrics_port_base,
    }
    tree = load_tree(config_path, sets, dict(os.environ))
    if not tree.get("trainer", {}).get("dynamic_sampling"):  # filtered groups need more prompts: no cap
        groups_per_step = tree.get("rl", {}).get("groups_per_step", 8)
        preset.setdefault("feed", {})["limit"] = opts.steps * groups_per_step + 200
    return plan_job(config_path, sets, preset, f"demo-{run_id}", flags, bootstrap)


def run(config_path: Path | None, sets: list[str], opts: DemoOptions) -> dict:
    """The demo; returns its report (``status`` ``ok`` when the trainer reached ``--steps``)."""
    from rich.console import Console

    from rlstream.job import checked_start, run_job
    from rlstream.launcher import early_fork_server

    console = Console(stderr=True)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    cfg, data = plan(config_path, sets, opts, run_id)
    record_job_dir(cfg, config_path)
    # (checked_start: a mistake is one line and creates nothing)
    with early_fork_server(cfg) as forks, checked_start(cfg, data, opts.keep_broker, console.print):
        own_task = cfg.job.dataset is not None and cfg.feed.source.name.startswith("next_digit")
        return run_job(
            cfg,
            title="rlstream demo",
            live=opts.live,
            console=console,
            forks=forks,
            extra_report={
                "steps_requested": opts.steps,
                "task": TASK if own_task else str(cfg.feed.source),
                "title": f"{TASK if own_task else 'custom task'}, k = {cfg.rl.max_staleness}",
            },
        )
