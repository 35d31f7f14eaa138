"""The best version by held-out eval, and the versions the checkpoint store must not prune.

The eval role (``rlstream eval`` following a run) scores every version it evaluates by a named
metric (``eval.best_metric``, e.g. ``pass_at_1``, better when higher or lower: ``eval.best_mode``)
and keeps one record in the checkpoint store, ``<store>/pins/best.json``:
``{version, metric, mode, score, uri, sha256, step, evaluated_at_ms}``, replaced (written whole,
atomically) when a version scores at least as well as the recorded one (of equal scores the newer
version is kept: it has trained more). Version 0, the base model, may be the best; it has no
weights in the store (``uri`` is null). Before the eval role loads a version it names it in
``<store>/pins/evaluating.json``, so the version it is scoring is not deleted under it while the
trainer moves on.

``gc_versions`` (``pipeline.checkpoint``) never deletes the versions the files in ``<store>/pins/``
name (``pinned_versions``): the best version survives the trainer's rolling window
(``trainer.keep_weight_versions``) across restarts of either role, and across machines that share
the store, because the store is the only thing they share. The record is a pointer, not a source of
truth: a version exists because its signed WeightUpdate on the control topic says so
(``pipeline.versions``); export and eval look the version up there and verify its weights against
the notice.

Not here: choosing the metric's values (the eval role computes them), or a second writer: one eval
role per job writes these files.
"""

from __future__ import annotations

import json
import logging
import time

from pipeline.checkpoint import PINS_DIR, atomic_write_bytes, join, read_small
from pipeline.log import kv

log = logging.getLogger(__name__)

METRICS = ("pass_at_1", "reward_mean", "response_tokens_mean", "truncated_fraction")
"""The eval metrics a best version can be chosen by (the eval role publishes them as ``eval_<name>``)."""


def best_uri(store: str) -> str:
    return join(store, PINS_DIR, "best.json")


def evaluating_uri(store: str) -> str:
    return join(store, PINS_DIR, "evaluating.json")


def _read_json(uri: str) -> dict | None:
    data = read_small(uri)
    if data is None:
        return None
    try:
        rec = json.loads(data)
    except ValueError:
        log.warning("ignoring an unreadable record %s", kv(uri=uri))
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("version"), int) else None


def read_best(store: str) -> dict | None:
    """The best-version record, or None when no version was scored (or the record is unreadable)."""
    return _read_json(best_uri(store))


def pin_evaluating(store: str, update: dict | None) -> None:
    """Name the version about to be loaded for evaluation (None: version 0, nothing to pin)."""
    if update is not None:
        atomic_write_bytes(evaluating_uri(store), json.dumps({"version": update["version"]}).encode())


def better(score: float, best: float, mode: str) -> bool:
    """Whether ``score`` replaces ``best``: at least as good (ties go to the newer version)."""
    return score >= best if mode == "max" else score <= best


def note_score(store: str, metric: str, mode: str, result: dict, update: dict | None) -> dict | None:
    """Record ``result`` (the eval role's figures for one version; its ``eval_<metric>``) as the best
    version if it scores at least as well as the recorded one, or if the record names another metric
    or mode. ``update``: the version's WeightUpdate (None: version 0). Returns the new record, or None
    when the old one stands."""
    version, score = result["version"], float(result[f"eval_{metric}"])
    old = read_best(store)
    if old is not None and old.get("metric") == metric and old.get("mode") == mode:
        if old["version"] == version or not better(score, float(old["score"]), mode):
            return None
    rec = {
        "version": version,
        "metric": metric,
        "mode": mode,
        "score": score,
        "uri": update["uri"] if update else None,
        "sha256": update["sha256"] if update else None,
        "step": (update.get("step") if update else 0) or 0,
        "evaluated_at_ms": int(time.time() * 1000),
    }
    atomic_write_bytes(best_uri(store), json.dumps(rec, indent=1, sort_keys=True).encode())
    log.info(
        "best version %s",
        kv(version=version, metric=metric, score=round(score, 4), previous=old and old.get("version")),
    )
    return rec
