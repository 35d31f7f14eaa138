"""``rlstream replay``: train a fresh trainer on an existing rl.scored log, to reproduce a run or to
compare losses or trainer settings on identical data.

The committed records of ``<source prefix>scored`` are copied, partition for partition and in order
(keys, values, headers), into the scored topic of this config's prefix, which must be a new one;
then a trainer runs there with its own checkpoint directory and control topic. The source topics
are only read.

Which groups each step takes:

* ``--from-run RUN_DIR`` (the original run dir, or its trainer checkpoint dir): the original's
  committed steps log becomes a schedule (``consumers.trainer.selection``). Replayed step ``n``
  takes exactly the groups the original step ``n`` took (and the groups dynamic sampling filtered
  with it), each closed with exactly the samples that step disposed of, at the same version
  ``n - 1``; samples the original refused (late, duplicate) are refused again. It runs as many
  steps as the log has (``--steps`` to stop earlier). If a scheduled group cannot be closed from
  the copied log (retention deleted part of it, or the steps log belongs to another run), the
  trainer stops with ``ScheduleError`` once it has read the log to its end.
* without it: ``trainer.group_order = "sequence"``: groups in (group_seq, group_id) order, each
  step planned only once the whole log has been read, so two replays of one log make the same
  steps (not necessarily the original's: a live trainer takes groups as they arrive). As many
  steps as the log holds complete steps of G groups.

What is reproduced exactly: per step, the groups, the samples used, dropped as stale, dropped as
incomplete, filtered and masked as overlong, given the same ``rl.max_staleness``,
``rl.staleness_rule``, ``incomplete_groups`` and ``overlong_filter`` (the schedule fixes the
groups and their members; the gate decides again, at the same versions). Equal losses and weights
need, in addition, the same model, trainer settings (loss, optimizer, micro-batching, minibatches,
seed), engine, world size and hardware and library versions: floating-point reductions are only
bit-identical on the same kernels. Pass the original's settings with ``--config``/``--set``;
changing them is how to compare settings on identical data. Not reproduced: wall-clock figures,
the timing of checkpoints, and anything of the rollout or reward side. What this is not: an offline
RL dataset tool; the records are replayed as they were scored.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline import codec
from pipeline.admin import Admin, ensure_topics
from pipeline.errors import ConfigError, DecodeError
from pipeline.kafka import Consumer, Producer, client_conf
from pipeline.log import kv

log = logging.getLogger(__name__)


def copy_scored(cfg, source_prefix: str) -> tuple[int, dict[str, set[str]]]:
    """Copy ``<source_prefix>scored`` into this prefix's scored topic. Returns the record count and,
    per trajectory id, the group ids its decodable records name."""
    src, dst = source_prefix + cfg.topics.scored.name, cfg.topics.name("scored")
    if src == dst:
        raise ConfigError(f"replay into {dst} itself: give a new topics.prefix")
    admin = Admin(client_conf(cfg, "replay"), cfg.kafka.request_timeout_s)
    try:
        if src not in admin.list_topics():
            raise ConfigError(f"no topic {src} to replay")
        parts = admin.describe([src])[src].partitions
    finally:
        admin.close()
    cfg.topics.scored.partitions = parts  # partition for partition
    ensure_topics(cfg, ["scored", "control", "metrics", "dlq"])
    group_of: dict[str, set[str]] = {}
    with Consumer(client_conf(cfg, "replay", kind="consumer")) as c:
        msgs = c.read_to_end(src, timeout=10 * cfg.kafka.request_timeout_s)
    with Producer(client_conf(cfg, "replay", kind="producer")) as p:
        for m in msgs:
            p.produce(dst, m.value(), key=m.key(), headers=m.headers(), partition=m.partition())
            try:
                t = codec.decode_as(m.value(), "ScoredTrajectory")["trajectory"]
                group_of.setdefault(t["trajectory_id"], set()).add(t["group_id"])
            except (DecodeError, TypeError, KeyError):
                pass  # not a sample: the trainer dead-letters it again
        p.flush_patiently(cfg.liveness.outage_s, "replayed records")
    groups = {g for gs in group_of.values() for g in gs}
    log.info("copied %s", kv(source=src, target=dst, records=len(msgs), groups=len(groups)))
    return len(msgs), group_of


def trainer_dir(run: Path) -> Path:
    """The trainer checkpoint dir of ``run``: itself if it holds a pointer, else ``run/trainer``."""
    from consumers.trainer.state import POINTER

    for d in (run, run / "trainer"):
        if (d / POINTER).is_file():
            return d
    raise ConfigError(f"--from-run {run}: no trainer checkpoint ({POINTER}) there or in {run / 'trainer'}")


def run(cfg, source_prefix: str, steps: int | None = None, from_run: Path | None = None) -> dict:
    """Copy the log, then train: the original's steps (``from_run``) or, in sequence order, every
    complete step the log holds; ``steps`` stops earlier."""
    from consumers.trainer.selection import schedule_from_steps_log
    from consumers.trainer.state import read_steps_log
    from consumers.trainer.worker import Trainer

    schedule = None
    if from_run is not None:
        original = read_steps_log(trainer_dir(Path(from_run)))
        if not original:
            raise ConfigError(f"--from-run {from_run}: the trainer there committed no step")
    records, group_of = copy_scored(cfg, source_prefix)
    groups = len({g for gs in group_of.values() for g in gs})
    if from_run is not None:
        schedule = schedule_from_steps_log(original, group_of)
        steps = min(steps or len(schedule), len(schedule))
    else:
        cfg.trainer.group_order = "sequence"
        steps = steps or groups // cfg.rl.groups_per_step
    if steps < 1:
        raise ConfigError(
            f"{source_prefix}scored holds {groups} groups, fewer than one step's {cfg.rl.groups_per_step}"
        )
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "replay.json").write_text(
        json.dumps({"source_prefix": source_prefix, "from_run": str(from_run) if from_run else None, "steps": steps})
    )
    reached = Trainer(cfg, max_steps=steps, schedule=schedule).run()
    return {
        "records": records,
        "groups": groups,
        "steps": reached,
        "prefix": cfg.topics.prefix,
        "order": "schedule" if schedule is not None else "sequence",
    }
