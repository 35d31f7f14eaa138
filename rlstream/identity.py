"""What a job is: its resolved settings, kept with the job, compared at every launch.

``rlstream run`` writes the job's resolved config (secrets redacted) at every start, once it holds
the job's lease: as ``<run dir>/job.json`` beside its checkpoints, and as a ``JobRecord`` on the
job's record topic (``topics.job``: ``<prefix>job``, one partition, kept forever), so a launch from
another machine sees it too. The next launch compares its own settings with the newest record:

* a **learned** setting changed (the model, the data, the reward tasks, the loss and advantage,
  the group size, the prompt format, the tools, ...): the launch is refused in one line
  (``JobChanged``) naming each changed key with its old and new value and what to do;
* a **place** changed (the run dir, the checkpoint store, the topics): refused the same way: one
  job lives in one place, never half in each;
* a **safe** setting changed (max steps, the learning-rate schedule, worker counts, eval cadence,
  logging, timeouts): applied, and said in one line (``resuming J at step 43; changed: ...``);
* an **own** setting (a process's worker id or port, the bootstrap address, the local broker's
  settings, paths resolved at launch) is not compared.

``CLASSES`` classifies every key of ``rlstream.config.Config`` by its longest dotted prefix; a
test fails when a new key is not classified. A ``--steps`` the job has already reached is refused
too (``NothingToTrain``): nothing would be trained.

What this is not: a lock (``rlstream.lease`` is), nor a check of the data's contents (the feed
checks its dataset's hash on resume) or of a reward module's code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pipeline import codec
from pipeline.admin import Admin, has_topic
from pipeline.config import dump_toml
from pipeline.errors import ConfigError, DecodeError, JobChanged, NothingToTrain
from pipeline.kafka import Consumer, Producer, client_conf
from pipeline.log import kv
from rlstream.lease import refuse_if_running

log = logging.getLogger(__name__)
SCHEMA = "JobRecord"
FILE = "job.json"
LEARNED, PLACE, SAFE, OWN = "learned", "place", "safe", "own"
REFUSED = (LEARNED, PLACE)

CLASSES: dict[str, str] = {
    # where the job lives: one job, one place
    "run_dir": PLACE,
    "checkpoint_store": PLACE,
    "trainer.checkpoint_dir": PLACE,
    "topics.prefix": PLACE,
    "topics.prompts.name": PLACE, "topics.rollouts.name": PLACE, "topics.scored.name": PLACE,
    "topics.control.name": PLACE, "topics.metrics.name": PLACE, "topics.dlq.name": PLACE,
    "topics.lease.name": PLACE, "topics.job.name": PLACE,
    "topics.prompts.partitions": PLACE, "topics.rollouts.partitions": PLACE, "topics.scored.partitions": PLACE,
    "topics.control.partitions": PLACE, "topics.metrics.partitions": PLACE, "topics.dlq.partitions": PLACE,
    "topics.lease.partitions": PLACE, "topics.job.partitions": PLACE,
    "topics": SAFE,  # retention, message size, replication
    "rollout.group_id": PLACE, "reward.group_id": PLACE, "trainer.group_id": PLACE,
    "reward.transactional_id_prefix": PLACE,
    # what is learned
    "model": LEARNED,
    "job.dataset": LEARNED,
    "feed.source": LEARNED, "feed.format": LEARNED, "feed.limit": LEARNED, "feed.shuffle_seed": LEARNED,
    "feed.default_task": LEARNED, "feed.id_field": LEARNED, "feed.messages_field": LEARNED,
    "feed.prompt_field": LEARNED, "feed.reference_field": LEARNED, "feed.task_field": LEARNED,
    "feed.name": LEARNED, "feed.mode": LEARNED,
    "rl.group_size": LEARNED, "rl.groups_per_step": LEARNED, "rl.max_staleness": LEARNED,
    "rl.staleness_rule": LEARNED,
    "reward.tasks": LEARNED, "reward.default": LEARNED,
    "rollout.add_generation_prompt": LEARNED, "rollout.chat_template": LEARNED, "rollout.system_prompt": LEARNED,
    "rollout.max_new_tokens": LEARNED, "rollout.max_prompt_tokens": LEARNED, "rollout.temperature": LEARNED,
    "rollout.overprovision": LEARNED, "rollout.overprovision_tail": LEARNED,
    "rollout.env.tasks": LEARNED, "rollout.env.options": LEARNED, "rollout.env.max_turns": LEARNED,
    "rollout.env.max_turn_tokens": LEARNED, "rollout.env.stop": LEARNED,
    "trainer.loss": LEARNED, "trainer.advantage": LEARNED, "trainer.lora": LEARNED, "trainer.engine": LEARNED,
    "trainer.dynamic_sampling": LEARNED, "trainer.dynamic_sampling_tol": LEARNED, "trainer.minibatches": LEARNED,
    "trainer.group_order": LEARNED, "trainer.incomplete_groups": LEARNED, "trainer.overlong_filter": LEARNED,
    "trainer.max_tokens_per_step": LEARNED,
    # safe to change on resume: applied and said
    "feed": SAFE,  # epochs, rate, dispatch, checkpoint cadence
    "rl.replicate": SAFE,
    "reward": SAFE,  # batching, executor, pool, sandbox limits, timeouts
    "rollout": SAFE,  # engine, in-flight limits, reload policy, timeouts
    "trainer": SAFE,  # lr and its schedule, optimizer, max steps, micro-batches, publishing, timeouts
    "eval": SAFE,
    "tracking": SAFE,
    "job": SAFE,  # worker counts, eval, standbys, export, metrics ports
    "liveness": SAFE,
    "lease": SAFE,
    "log_level": SAFE,
    "kafka": SAFE,  # client settings
    # a process's own, or fixed at launch: not compared
    "job.name": OWN,
    "kafka.bootstrap_servers": OWN,
    "kafka.client_id_prefix": OWN,
    "broker": OWN,
    "reward.import_dirs": OWN, "rollout.env.import_dirs": OWN,
    "reward.worker_id": OWN, "reward.group_instance_id": OWN, "rollout.worker_id": OWN, "rollout.slots": OWN,
    "trainer.trainer_id": OWN, "trainer.standby": OWN, "eval.worker_id": OWN,
    "reward.prometheus_port": OWN, "rollout.prometheus_port": OWN, "trainer.prometheus_port": OWN,
    "eval.prometheus_port": OWN,
}  # fmt: skip
"""Dotted key prefix -> class; a key takes the class of its longest prefix here."""


def classify(key: str) -> str | None:
    """The class of a dotted config key (longest prefix in ``CLASSES``; list indexes ``[i]`` are
    the list's key), None if unclassified."""
    parts = re.sub(r"\[\d+\]", "", key).split(".")
    for n in range(len(parts), 0, -1):
        hit = CLASSES.get(".".join(parts[:n]))
        if hit is not None:
            return hit
    return None


def flatten(tree, prefix: str = "") -> dict[str, object]:
    """Dotted key -> leaf value: tables and lists of tables are walked (``key[i].field``), so a
    change is named where it is; other lists and scalars are leaves."""
    out: dict[str, object] = {}
    items = tree.items() if isinstance(tree, dict) else ((f"[{i}]", v) for i, v in enumerate(tree))
    for k, v in items:
        key = f"{prefix}{k}" if k.startswith("[") or not prefix else f"{prefix}.{k}"
        if (isinstance(v, dict) and v) or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def settings_of(cfg) -> dict:
    """The job's resolved settings as a plain tree, secrets redacted (what is stored)."""
    return tomllib.loads(dump_toml(cfg, redact=True))


MISSING = object()


@dataclass(frozen=True)
class Change:
    key: str
    kind: str
    old: object
    new: object

    def __str__(self) -> str:
        return f"{self.key} {show(self.old)} -> {show(self.new)}"


def show(value, limit: int = 60) -> str:
    if value is MISSING:
        return "(unset)"
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def changes(old: dict, new: dict) -> list[Change]:
    """The compared keys whose values differ between two settings trees, sorted by key."""
    a, b = flatten(old), flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        kind = classify(key) or LEARNED  # an unknown key (a newer rlstream's) is not waved through
        va, vb = a.get(key, MISSING), b.get(key, MISSING)
        if kind != OWN and va != vb:
            out.append(Change(key, kind, va, vb))
    return out


# ---- where the record is kept -------------------------------------------------------------------
def read_file(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not the job record rlstream writes ({exc}); move it away and run again") from None


def read_kafka(cfg) -> dict | None:
    """The newest record on the job's record topic; None when the topic or a record is missing."""
    topic = cfg.topics.name("job")
    if not has_topic(cfg, topic):
        return None
    with Consumer(client_conf(cfg, "job", kind="consumer")) as c:
        msgs = c.read_to_end(topic, timeout=cfg.kafka.request_timeout_s)
    newest = None
    for m in msgs:
        try:
            r = codec.decode_as(m.value(), SCHEMA)
        except DecodeError as exc:  # a foreign record must not make the job unstartable
            log.warning("skipped a record on the job topic %s", kv(offset=m.offset(), error=exc))
            continue
        newest = {
            "job": r["job"],
            "run_dir": r["run_dir"],
            "settings": json.loads(r["config_json"]),
            "forked_from": json.loads(r["forked_from_json"]) if r["forked_from_json"] else None,
            "host": r["host"],
            "written_at_ms": r["written_at_ms"],
        }
    return newest


def read(cfg) -> dict | None:
    """The job's newest record: Kafka's (another machine may have run it), else the run dir's."""
    return read_kafka(cfg) or read_file(cfg.run_dir)


def write(cfg, forked_from: dict | None = None) -> dict:
    """Store the job's settings: ``<run dir>/job.json`` (atomically) and a record on its topic."""
    from pipeline import __version__

    rec = {
        "job": cfg.job.name,
        "run_dir": str(cfg.run_dir),
        "settings": settings_of(cfg),
        "forked_from": forked_from,
        "host": socket.gethostname(),
        "written_at_ms": int(time.time() * 1000),
    }
    path = Path(cfg.run_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, path)
    topic = cfg.topics.name("job")
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    try:
        admin.create_topics({topic: cfg.topics.job}, cfg.topics.replication_factor, cfg.topics.min_insync_replicas)
    finally:
        admin.close()
    record = {
        "job": rec["job"],
        "run_dir": rec["run_dir"],
        "config_json": json.dumps(rec["settings"]),
        "forked_from_json": json.dumps(forked_from) if forked_from else "",
        "host": rec["host"],
        "rlstream_version": __version__,
        "written_at_ms": rec["written_at_ms"],
    }
    producer = Producer(client_conf(cfg, "job", kind="producer"))
    try:
        producer.produce_record(topic, SCHEMA, record, key=b"job")
    finally:
        producer.close(cfg.kafka.request_timeout_s)  # DeliveryError when it was not written
    log.info("job record written %s", kv(topic=topic, file=path))
    return rec


# ---- the comparison ------------------------------------------------------------------------------
def current_step(cfg) -> int | None:
    """The step of the job's newest trainer checkpoint, None for a fresh job."""
    from consumers.trainer.state import TrainerCheckpoints, trainer_root

    try:
        ptr = TrainerCheckpoints(trainer_root(cfg)).read_pointer()
    except Exception as exc:  # a damaged pointer is the trainer's to report (it falls back): not here
        log.info("no step read from the trainer checkpoint %s", kv(error=exc))
        return None
    return None if ptr is None else int(ptr.get("step", 0))


HOW = "Start it over with --restart, branch it with --fork NEW, or undo the change"


def check(cfg, stored: dict | None) -> str | None:
    """Compare the launch's ``cfg`` with the job's ``stored`` record: ``JobChanged`` (one line) for a
    changed learned setting or place, ``NothingToTrain`` for a ``trainer.max_steps`` the job has
    reached; else the line to say (``resuming ...``), None for a fresh job."""
    name = cfg.job.name
    step = current_step(cfg)
    if stored is not None and str(stored["run_dir"]) != str(cfg.run_dir):
        refuse_if_running(cfg)  # a running job is the first thing to say
        raise JobChanged(
            f"job {name} lives in {stored['run_dir']}, but this launch would use {cfg.run_dir}: run it with "
            f"-s run_dir={Path(stored['run_dir']).parent} (its parent), or give this one another name "
            f"([job] name, or --fork NEW)"
        )
    diff = changes(stored["settings"], settings_of(cfg)) if stored is not None else []
    refused = [c for c in diff if c.kind in REFUSED]
    if refused:
        refuse_if_running(cfg)
        raise JobChanged(f"job {name} was trained with other settings: {'; '.join(map(str, refused))}. {HOW}")
    if step is not None and step >= cfg.trainer.max_steps:
        raise NothingToTrain(
            f"job {name} is at step {step} already, and trainer.max_steps is {cfg.trainer.max_steps}: nothing to "
            f"train; give --steps above {step}, or start it over with --restart"
        )
    if step is None:
        return None if stored is None else f"starting {name} (nothing trained yet)"
    safe = [c for c in diff if c.kind == SAFE]
    where = f"resuming {name} at step {step or 0}"
    if stored is None:
        return f"{where} (its settings were not recorded before: recorded from now on)"
    return f"{where}; changed: {', '.join(map(str, safe))}" if safe else f"{where}; no settings changed"
