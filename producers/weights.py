"""A rollout worker's side of weight updates: follow rl.control, fetch and verify each newer
checkpoint in a background thread while generation goes on, and hand it to the engine at the
safe point the worker chooses (``load``).

The background part is the engine's ``prepare_weights``: for a sharded checkpoint (format
``safetensors-sharded``) it reads the shards in parallel, verifies each against the index the
notice's sha256 covers, and stages each as soon as it is verified (``pipeline.checkpoint``). The
generation pause is ``load`` alone (``swap ms``), which an engine keeps to a swap where it can.

A notice whose checkpoint is **unavailable** (missing or unreadable: the store is slow to show it,
or away for a while) is retried with backoff (``RETRY_S`` doubling up to ``RETRY_MAX_S``), each
failure said in the log (``weights v7 unavailable at <uri> (retrying, 3 tries)``), for as long as
the version can still be used: until a newer notice (or another of the same version) supersedes
it; it is then dead-lettered with its reason (``ControlFollower.reject``) and the newer one is
fetched. A checkpoint that is there but **wrong** (sha256 mismatch, not a checkpoint) is tried
``FETCH_TRIES`` times, then dead-lettered and skipped at once. Meanwhile the worker keeps
generating on the weights it has, within admission. Notices that are not plausible
(a version that does not follow the newest, no uri) or not written by the job's trainer (unsigned,
a bad signature, a replaced trainer's epoch: ``pipeline.notice_auth``) never get here
(``pipeline.control``).

A notice whose format the engine does not declare in ``weight_formats``, or whose kind (``full``
weights or a LoRA ``adapter``) it does not declare in ``weight_kinds``, is refused loudly
(``WeightFormatError``, the worker exits non-zero): the run's engine and trainer disagree, and
every later notice would be refused too. So does an adapter trained on another base model
(``BaseModelMismatch``, raised by the engine's ``prepare_weights``).

Admission (``may_admit``): the worker's loaded version and the trainer's consumed-group count
known for it (``pipeline.control``); ``admission_moves`` tells the worker when that count grew
without a new version (dynamic sampling), so it re-checks the prompts it holds.

What this is not: the drain/interrupt policy (the worker decides when it is safe to load), nor
the trainer's publishing (``pipeline.control.publish_weight_update``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from libs.engines.adapters import BaseModelMismatch
from pipeline.control import ControlFollower, may_admit
from pipeline.errors import RlstreamError
from pipeline.log import kv
from pipeline.records import update_format, update_kind

log = logging.getLogger(__name__)
FETCH_TRIES = 3
"""Tries of a checkpoint that is there but does not verify, before it is dead-lettered."""
RETRY_S = 2.0
"""Seconds before the second try of one notice's fetch (doubling at each further try)."""
RETRY_MAX_S = 30.0
"""The longest wait between two tries of an unavailable checkpoint."""


class WeightFormatError(RlstreamError):
    """A WeightUpdate announces weights the rollout engine cannot load."""


class WeightSync:
    def __init__(self, cfg, worker_id: str, engine):
        self.engine = engine
        self.k, self.G = cfg.rl.max_staleness, cfg.rl.groups_per_step
        self.control = ControlFollower(cfg, "rollout", worker_id)
        self._progress_seen = 0
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._fetch: tuple[dict, Future, float, int] | None = None  # update being fetched and verified
        self.loadable: tuple[dict, object, float] | None = None  # verified, waiting for a safe point
        self._retry: tuple[dict, float, int] | None = None  # notice whose fetch failed: when to retry, tries
        self.fetch_ms: float | None = None
        """Fetch + verify time of the last checkpoint that became loadable."""
        self.fetch_failures = 0

    @property
    def pending(self) -> bool:
        """A newer version is being fetched, waits for a retry, or waits to be loaded."""
        return self._fetch is not None or self._retry is not None or self.loadable is not None

    def wait_fetch(self, timeout: float) -> bool:
        """If a fetch is in flight, wait up to ``timeout`` for it to end (``poll`` then promotes it);
        False at once if none is. An idle worker waits on its next weights, not on new prompts."""
        if self._fetch is None:
            return False
        wait([self._fetch[1]], timeout)
        return True

    def catch_up(self, timeout: float) -> dict | None:
        """Read rl.control to its end; start fetching its newest notice if it is newer."""
        update = self.control.catch_up(timeout)
        self.poll()
        return update

    def poll(self) -> bool:
        """Follow rl.control; start a fetch for a newer notice; promote a finished fetch. True if a
        control record was read or a fetch ended (an idle worker stops waiting on prompts)."""
        moved = bool(self.control.poll(0))
        self.control.commands.clear()  # feed states and operator commands: not the worker's business
        upd, tries = self.control.latest_update, 0
        if self._retry is not None and self._superseded(self._retry[0]):
            old, _, tries = self._retry
            self._retry = None
            reason = f"weights v{old['version']} at {old['uri']!r} were unavailable ({tries} tries) and are superseded"
            self.control.reject(old, "unverifiable_checkpoint", reason)
            upd = self.control.latest_update
        if self._retry is not None:  # a failed notice is retried while no newer one supersedes it
            if time.monotonic() < self._retry[1]:
                upd = None
            else:
                (upd, _, tries), self._retry = self._retry, None
        if upd is not None and upd["version"] > self.engine.version and not self.pending:
            check_loadable(upd, self.engine)
            log.info("fetching weights %s", kv(version=upd["version"], uri=upd["uri"], format=update_format(upd)))
            self._fetch = (upd, self._loader.submit(self.engine.prepare_weights, upd), time.monotonic(), tries)
        if self._fetch is not None and self._fetch[1].done():
            upd, fut, t0, tries = self._fetch
            self._fetch = None
            try:
                prepared = fut.result()
            except (WeightFormatError, BaseModelMismatch):
                raise  # the run's engine and trainer disagree: every notice would fail so
            except Exception as exc:  # missing, unreadable, sha256 mismatch: retried, then skipped
                self._fetch_failed(upd, tries + 1, exc)
                return True
            self.fetch_ms = (time.monotonic() - t0) * 1e3
            self.loadable = (upd, prepared, t0)
            moved = True
        return moved

    def _superseded(self, upd: dict) -> bool:
        """A newer notice, or another of the same version, was accepted after ``upd``."""
        newest = self.control.latest_update
        return newest is not None and newest is not upd and newest["version"] >= upd["version"]

    def _fetch_failed(self, upd: dict, tries: int, exc: Exception) -> None:
        self.fetch_failures += 1
        reason = (
            f"weights v{upd['version']} at {upd['uri']!r} could not be fetched or verified ({tries} tries): {exc!r}"
        )
        unavailable = isinstance(exc, OSError)  # missing or unreadable, not wrong: it may yet appear
        if unavailable and not self._superseded(upd):
            log.warning(
                "weights v%s unavailable at %s (retrying, %d %s) %s",
                upd["version"],
                upd["uri"],
                tries,
                "try" if tries == 1 else "tries",
                kv(error=exc),
            )
            self._retry = (upd, time.monotonic() + min(RETRY_MAX_S, RETRY_S * 2 ** (tries - 1)), tries)
        elif tries < FETCH_TRIES and not unavailable:
            log.warning("weight fetch failed, will retry %s", kv(version=upd["version"], tries=tries, error=exc))
            self._retry = (upd, time.monotonic() + RETRY_S * tries, tries)
        else:
            self.control.reject(upd, "unverifiable_checkpoint", reason)

    def may_admit(self, group_seq: int) -> bool:
        """May a group start under the engine's loaded version (``pipeline.control.may_admit``
        with the trainer's consumed-group count for that version)?"""
        v = self.engine.version
        return may_admit(group_seq, v, self.k, self.G, self.control.consumed_groups(v))

    def admission_moves(self) -> bool:
        """True once after the consumed-group counts changed (held prompts may now be admissible)."""
        moved = self.control.progress_seen != self._progress_seen
        self._progress_seen = self.control.progress_seen
        return moved

    def wait_loadable(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (self._fetch is not None or self._retry is not None) and self.loadable is None:
            if time.monotonic() > deadline:
                upd = (self._fetch or self._retry)[0]
                what = "unavailable at" if self._fetch is None else "still being fetched from"
                raise TimeoutError(f"weights v{upd['version']} {what} {upd['uri']} after {timeout} s")
            self.poll()
            time.sleep(0.01)

    def load(self) -> tuple[dict, float, float]:
        """Swap the loadable weights into the engine (nothing may be in flight).
        Returns ``(update, fetch-to-loaded ms, swap ms)``."""
        upd, prepared, t0 = self.loadable
        t1 = time.monotonic()
        self.engine.load_weights(upd, prepared)
        self.loadable = None
        return upd, (time.monotonic() - t0) * 1e3, (time.monotonic() - t1) * 1e3

    def close(self) -> None:
        try:
            self.control.close()
        finally:
            self._loader.shutdown(wait=False, cancel_futures=True)


def check_loadable(update: dict, engine) -> None:
    """``WeightFormatError`` unless ``engine`` declares the update's format and kind."""
    fmt = update_format(update)
    if fmt not in engine.weight_formats:
        raise WeightFormatError(
            f"weight update v{update['version']} has format {fmt!r}; the {engine.name} engine loads "
            f"{sorted(engine.weight_formats)}"
        )
    kind = update_kind(update)
    kinds = engine.weight_kinds
    if kind not in kinds:
        raise WeightFormatError(
            f"weight update v{update['version']} is a {kind!r} update (trainer.lora publishes adapters); the "
            f"{engine.name} engine loads {sorted(kinds)}: refusing to generate under weights it cannot load"
        )
