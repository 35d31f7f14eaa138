"""The jobs on a cluster, and the two things done to one as a whole: start it over, and fork it.

* ``list_jobs(cfg)``: ``rlstream jobs``: every job with a lease topic (``<name>.lease``: every
  launcher makes one) on the broker: whether it runs (host and pid of its launcher, from the
  lease), its newest published version and step (its control topic), its run dir (its record,
  ``rlstream.identity``) and its last held-out eval (its report, where the run dir is on this
  machine).
* ``remove(cfg, say)``: ``rlstream jobs rm NAME`` and ``rlstream run --restart``: refused while the
  job runs (its lease); else prints what it deletes, then deletes the job's topics, consumer
  groups, run dir and checkpoint store. A static member stays in its consumer group until its
  session times out, so the groups may take that long to go (said on screen).
* ``fork_model(parent, version, dest, say)``: the base model of a fork: version N (default: the
  newest in the store) of the parent job exported as an HF directory (``rlstream.export``).

What this is not: a scheduler; nothing here starts a role.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from pipeline.admin import Admin
from pipeline.config import with_settings
from pipeline.errors import ConfigError, RlstreamError
from pipeline.kafka import client_conf
from pipeline.log import kv
from pipeline.topology import PIPELINE

log = logging.getLogger(__name__)
LEASE_SUFFIX = "lease"


# ---- start over ---------------------------------------------------------------------------------
def job_topics(cfg) -> list[str]:
    return [cfg.topics.name(r) for r in [*cfg.topics.specs(), "lease", "job"]]


def job_groups(cfg) -> list[str]:
    return [getattr(cfg, s).group_id for s in PIPELINE]


def store_is_local(cfg) -> Path | None:
    store = cfg.store
    if "://" in store and not store.startswith("file://"):
        return None
    return Path(store.removeprefix("file://"))


def remove(cfg, say, wait_groups_s: float | None = None) -> dict:
    """Delete the job's topics, consumer groups, run dir and checkpoint store (refused while it
    runs: ``JobAlreadyRunning``). Returns what happened to each, by name."""
    from rlstream.lease import JobLease

    name = cfg.job.name or cfg.topics.prefix
    run_dir = Path(cfg.run_dir)
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    try:
        there = admin.list_topics()
        topics = [t for t in job_topics(cfg) if t in there]
        groups = sorted(set(job_groups(cfg)) & admin.list_groups())
        if cfg.topics.name("lease") in there:  # running? the lease tells (and then refuses)
            JobLease(cfg, run_dir, say=say).acquire().release(quiet=True)
        store = store_is_local(cfg)
        inside = store is not None and store.resolve().is_relative_to(run_dir.resolve())
        files = [p for p in (run_dir, None if inside else store) if p is not None and p.exists()]
        files_note = "" if store is not None else f"; the checkpoint store {cfg.store} is remote: delete it yourself"
        if not (topics or groups or files):
            say(f"job {name}: nothing to delete (no topic, group or file of it)")
            return {}
        say(
            f"deleting job {name}: topics {', '.join(topics) or 'none'}; consumer groups {', '.join(groups) or 'none'}; "
            f"files {', '.join(map(str, files)) or 'none'}{files_note}"
        )
        done = {f"topic {t}": r for t, r in admin.delete_topics(topics).items()}
        _wait_gone(admin, topics, cfg.kafka.request_timeout_s + 30)
        done.update(_delete_groups(admin, cfg, groups, say, wait_groups_s))
    finally:
        admin.close()
    for p in files:
        shutil.rmtree(p, ignore_errors=False) if p.is_dir() else p.unlink()
        done[f"files {p}"] = "deleted"
    log.info("job removed %s", kv(job=name, **{k.replace(" ", "_"): v for k, v in done.items()}))
    return done


def _wait_gone(admin: Admin, topics: list[str], limit: float) -> None:
    deadline = time.monotonic() + limit
    while set(topics) & admin.list_topics():
        if time.monotonic() > deadline:
            raise RlstreamError(f"topics {', '.join(set(topics) & admin.list_topics())} still exist {limit:.0f} s after "
                                "their deletion: check the broker (rlstream broker logs)")  # fmt: skip
        time.sleep(0.5)


def _delete_groups(admin: Admin, cfg, groups: list[str], say, wait_s: float | None) -> dict[str, str]:
    """Delete ``groups``, waiting up to ``wait_s`` (default: the longest session timeout + 15 s)
    for static members of a stopped run to time out."""
    if wait_s is None:
        wait_s = max(cfg.reward.session_timeout_ms, cfg.rollout.session_timeout_ms) / 1000 + 15
    deadline, told = time.monotonic() + wait_s, False
    out: dict[str, str] = {}
    todo = list(groups)
    while todo:
        got = admin.delete_groups(todo)
        out.update({f"group {g}": r for g, r in got.items()})
        todo = [g for g, r in got.items() if r == "not empty"]
        if not todo:
            break
        if time.monotonic() > deadline:
            raise RlstreamError(
                f"consumer groups {', '.join(todo)} still have members {wait_s:.0f} s on: a process of the job "
                f"still runs somewhere (rlstream kafka-tool consumer-groups --describe --group {todo[0]})"
            )
        if not told:
            say(f"waiting for consumer groups {', '.join(todo)} to empty (static members leave when their session "
                f"times out: up to {wait_s:.0f} s)")  # fmt: skip
            told = True
        time.sleep(1.0)
    return out


# ---- fork -------------------------------------------------------------------------------------
def fork_model(parent, version: int | None, dest: Path, say) -> dict:
    """Export version ``version`` of the ``parent`` job (its config, connected) into ``dest`` as an
    HF model directory: the base model of a fork. Returns ``{job, version, sha256, run_dir}``."""
    from pipeline.records import update_kind
    from pipeline.versions import find_update
    from rlstream.export import export

    update = find_update(parent, version)
    if update_kind(update) != "full":
        raise ConfigError(
            f"version {update['version']} of job {parent.job.name} is a LoRA adapter: a fork starts from full "
            "weights; fork from version 0 (--from-version 0) with the same trainer.lora, or export a merged model"
        )
    say(f"forking from job {parent.job.name} version {update['version']}: exporting its weights to {dest}")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export(parent, tmp, update["version"])
    tmp.rename(dest)
    return {"job": parent.job.name, "version": update["version"], "sha256": update["sha256"],
            "run_dir": str(parent.run_dir)}  # fmt: skip


# ---- list -------------------------------------------------------------------------------------
def job_config(cfg, name: str):
    """The config of the job ``name`` on the cluster of ``cfg``: its record's (``rlstream.identity``)
    with ``cfg``'s Kafka settings, else ``cfg`` with the job's names (``<name>.*`` topics,
    ``<name>-<stage>`` groups, run dir ``<run_dir>/<name>``). The record, if any, is ``cfg._record``."""
    from pipeline.config import validate
    from pipeline.topology import RunIdentity
    from rlstream.config import Config
    from rlstream.identity import read_kafka

    probe = cfg.model_copy(deep=True)
    probe.topics.prefix = f"{name}."
    rec = read_kafka(probe)
    job = None
    if rec is not None:
        try:
            tree = {**rec["settings"], "kafka": cfg.kafka.model_dump(mode="json"),
                    "broker": cfg.broker.model_dump(mode="json")}  # fmt: skip
            job = validate(Config, tree)
        except ConfigError as exc:  # a record of another rlstream version: what is known is shown
            log.info("job record not read %s", kv(job=name, error=exc))
    if job is None:
        tree = {"run_dir": str(Path(cfg.run_dir).resolve() / name), "job": {"name": name}}
        job = with_settings(cfg, {**tree_settings(tree), **RunIdentity.of_job(name).settings()})
    return job, rec


def tree_settings(tree: dict) -> dict:
    return {"run_dir": tree["run_dir"], "job.name": tree["job"]["name"]}


def list_jobs(cfg) -> list[dict]:
    """Every job on the cluster of ``cfg`` (one with a lease topic), by name."""
    admin = Admin(client_conf(cfg, "admin"), cfg.kafka.request_timeout_s)
    try:
        topics = admin.list_topics()
    finally:
        admin.close()
    out = []
    for topic in sorted(topics):
        if topic.endswith("." + LEASE_SUFFIX):
            name = topic[: -len(LEASE_SUFFIX) - 1]
            job, rec = job_config(cfg, name)
            out.append(describe_job(job, name, rec))
    return out


def describe_job(cfg, name: str, rec: dict | None) -> dict:
    """A row of ``rlstream jobs``."""
    import json

    from rlstream.lease import live_holder

    row = {"job": name, "running": False, "host": None, "pid": None, "version": None, "step": None,
           "run_dir": rec["run_dir"] if rec else None, "last_eval": None,
           "forked_from": rec.get("forked_from") if rec else None}  # fmt: skip
    holder = live_holder(cfg)
    if holder is not None:
        row.update(running=True, host=holder["host"], pid=holder["pid"])
        row["run_dir"] = row["run_dir"] or holder.get("run_dir") or None
    try:
        from pipeline.versions import published

        updates = published(cfg)
        if updates:
            newest = updates[max(updates)]
            row.update(version=newest["version"], step=newest.get("step"))
    except (RlstreamError, TimeoutError, OSError) as exc:
        log.info("versions not read %s", kv(job=name, error=exc))
    report = Path(row["run_dir"] or cfg.run_dir) / "report.json"
    if report.is_file():
        try:
            r = json.loads(report.read_text())
            curve = r.get("eval_curve") or []
            if curve:
                v, reward, pass1 = curve[-1][:3]
                row["last_eval"] = {"version": v, "reward_mean": reward, "pass_at_1": pass1}
            row["step"] = row["step"] if row["step"] is not None else r.get("steps_completed")
        except ValueError:
            pass
    return row
