"""A rollout worker's side of weight updates: follow rl.control, fetch and verify each newer
checkpoint in a background thread while generation goes on, and hand it to the engine at the
safe point the worker chooses (``load``).

A notice whose format the engine does not declare in ``weight_formats`` is refused loudly
(``WeightFormatError``): a worker never generates under weights it did not load. A checkpoint
that does not match its sha256 stops the worker the same way (``ChecksumError``).

What this is not: the drain/interrupt policy (the worker decides when it is safe to load), nor
the trainer's publishing (``pipeline.control.publish_weight_update``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.control import ControlFollower
from pipeline.errors import RlstreamError
from pipeline.log import kv

log = logging.getLogger(__name__)


class WeightFormatError(RlstreamError):
    """A WeightUpdate announces weights the rollout engine cannot load."""


class WeightSync:
    def __init__(self, cfg, worker_id: str, engine):
        self.engine = engine
        self.control = ControlFollower(cfg, "rollout", worker_id)
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
            fmt = upd.get("format") or "safetensors"
            if fmt not in self.engine.weight_formats:
                raise WeightFormatError(
                    f"weight update v{upd['version']} has format {fmt!r}; the {self.engine.name} engine loads "
                    f"{sorted(self.engine.weight_formats)}"
                )
            log.info("fetching weights %s", kv(version=upd["version"], uri=upd["uri"]))
            self._fetch = (upd, self._loader.submit(self.engine.prepare_weights, upd), time.monotonic())
        if self._fetch is not None and self._fetch[1].done():
            upd, fut, t0 = self._fetch
            self._fetch = None
            prepared = fut.result()  # a bad checksum or unreadable checkpoint stops the worker loudly
            self.fetch_ms = (time.monotonic() - t0) * 1e3
            self.loadable = (upd, prepared, t0)

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
