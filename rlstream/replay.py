"""``rlstream replay``: train a fresh trainer on an existing rl.scored log, to reproduce a run or to
compare losses or trainer settings on identical data.

The committed records of ``<source prefix>scored`` are copied, partition for partition and in order
(keys, values, headers), into the scored topic of this config's prefix, which must be a new one;
then the trainer runs there with its own checkpoint directory and control topic, for as many steps
as the log holds complete groups (``--steps`` to stop earlier). The trainer takes groups by
``group_seq`` and its versions advance one per step, so with the same trainer settings it makes
the same staleness decisions and the same updates as the original run; the source topics are only
read.

What this is not: an offline RL dataset tool; the records are replayed as they were scored.
"""

from __future__ import annotations

import logging

from pipeline import codec
from pipeline.admin import Admin, ensure_topics
from pipeline.errors import ConfigError, DecodeError
from pipeline.kafka import Consumer, Producer, client_conf
from pipeline.log import kv

log = logging.getLogger(__name__)


def copy_scored(cfg, source_prefix: str) -> tuple[int, int]:
    """Copy ``<source_prefix>scored`` into this prefix's scored topic; returns (records, groups)."""
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
    groups: set[str] = set()
    with Consumer(client_conf(cfg, "replay", kind="consumer")) as c:
        msgs = c.read_to_end(src, timeout=10 * cfg.kafka.request_timeout_s)
    with Producer(client_conf(cfg, "replay", kind="producer")) as p:
        for m in msgs:
            p.produce(dst, m.value(), key=m.key(), headers=m.headers(), partition=m.partition())
            try:
                rec = codec.decode_as(m.value(), "ScoredTrajectory")
                groups.add(rec["trajectory"]["group_id"])
            except (DecodeError, TypeError, KeyError):
                pass  # the trainer dead-letters it again
        p.flush_patiently(cfg.liveness.outage_s, "replayed records")
    log.info("copied %s", kv(source=src, target=dst, records=len(msgs), groups=len(groups)))
    return len(msgs), len(groups)


def run(cfg, source_prefix: str, steps: int | None = None) -> dict:
    """Copy the log, then train ``steps`` (default: every complete step the log holds)."""
    from consumers.trainer.worker import Trainer

    records, groups = copy_scored(cfg, source_prefix)
    steps = steps or groups // cfg.rl.groups_per_step
    if steps < 1:
        raise ConfigError(
            f"{source_prefix}scored holds {groups} groups, fewer than one step's {cfg.rl.groups_per_step}"
        )
    reached = Trainer(cfg, max_steps=steps).run()
    return {"records": records, "groups": groups, "steps": reached, "prefix": cfg.topics.prefix}
