"""A rollout worker's side of weight updates: follow rl.control, fetch and verify each newer
checkpoint in a background thread while generation goes on, and hand it to the engine at the
safe point the worker chooses (``load``).

The background part is the engine's ``prepare_weights``: for a sharded checkpoint (format
``safetensors-sharded``) it reads the shards in parallel, verifies each against the index the
notice's sha256 covers, and stages each as soon as it is verified (``pipeline.checkpoint``). The
generation pause is ``load`` alone (``swap ms``), which an engine keeps to a swap where it can.

A notice whose format the engine does not declare in ``weight_formats``, or whose kind (``full``
weights or a LoRA ``adapter``) it does not declare in ``weight_kinds``, is refused loudly
(``WeightFormatError``, the worker exits non-zero): a worker never generates under weights it did
not load. A checkpoint that does not match its sha256 stops the worker the same way
(``ChecksumError``), and so does an adapter trained on another base model (``BaseModelMismatch``,
raised by the engine's ``prepare_weights``).

Admission (``may_admit``): the worker's loaded version and the trainer's consumed-group count
known for it (``pipeline.control``); ``admission_moves`` tells the worker when that count grew
without a new version (dynamic sampling), so it re-checks the prompts it holds.

What this is not: the drain/interrupt policy (the worker decides when it is safe to load), nor
the trainer's publishing (``pipeline.control.publish_weight_update``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.control import ControlFollower, may_admit
from pipeline.errors import RlstreamError
from pipeline.log import kv
from pipeline.records import update_format, update_kind

log = logging.getLogger(__name__)


class WeightFormatError(RlstreamError):
    """A WeightUpdate announces weights the rollout engine cannot load."""


class WeightSync:
    def __init__(self, cfg, worker_id: str, engine):
        self.engine = engine
        self.k, self.G = cfg.rl.max_staleness, cfg.rl.groups_per_step
        self.control = ControlFollower(cfg, "rollout", worker_id)
        self._progress_seen = 0
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._fetch: tuple[dict, Future, float] | None = None  # update being fetched and verified
        self.loadable: tuple[dict, object, float] | None = None  # verified, waiting for a safe point
        self.fetch_ms: float | None = None
        """Fetch + verify time of the last checkpoint that became loadable."""

    @property
    def pending(self) -> bool:
        """A newer version is being fetched or waits to be loaded."""
        return self._fetch is not None or self.loadable is not None

    def catch_up(self, timeout: float) -> dict | None:
        """Read rl.control to its end; start fetching its newest notice if it is newer."""
        update = self.control.catch_up(timeout)
        self.poll()
        return update

    def poll(self) -> None:
        """Follow rl.control; start a fetch for a newer notice; promote a finished fetch."""
        self.control.poll(0)
        self.control.commands.clear()  # feed states and operator commands: not the worker's business
        upd = self.control.latest_update
        if upd is not None and upd["version"] > self.engine.version and not self.pending:
            check_loadable(upd, self.engine)
            log.info("fetching weights %s", kv(version=upd["version"], uri=upd["uri"], format=update_format(upd)))
            self._fetch = (upd, self._loader.submit(self.engine.prepare_weights, upd), time.monotonic())
        if self._fetch is not None and self._fetch[1].done():
            upd, fut, t0 = self._fetch
            self._fetch = None
            prepared = fut.result()  # a bad checksum or unreadable checkpoint stops the worker loudly
            self.fetch_ms = (time.monotonic() - t0) * 1e3
            self.loadable = (upd, prepared, t0)

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
        while self._fetch is not None and self.loadable is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fetching weights v{self._fetch[0]['version']} took more than {timeout} s")
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
