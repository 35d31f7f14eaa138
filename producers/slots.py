"""Rollout slots: static membership for the rollout workers, with a warm spare (``rollout.slots``;
``job.rollout_standby`` runs one spare beside the workers).

A worker takes the first free one of ``rollout.slots`` locks in ``<run_dir>/rollout-slots`` and joins
the rollout group as the static member ``rollout-slot-<i>``. While every slot is held it is a spare:
its engine is built and its weights follow rl.control, and it tries the locks until one is free. The
OS frees a lock the moment its holder dies (kill -9 included, ``pipeline.pidlock``), so the spare
joins under the dead worker's ``group.instance.id`` at once: the coordinator hands it the dead
member's partitions without a rebalance, instead of leaving them unowned for a session timeout and
then moving them (a rollout kill cost the trainer 4.5-5.7 s at the broker's 6 s floor). The new
member reads from the committed prompt offsets, as any restart does (nothing lost; the trainer
drops repeated trajectory ids). A restarted worker finds the slots held and becomes the spare;
with no spare (``rollout.slots`` = the number of workers, no ``job.rollout_standby``) it takes back
the slot it left, and with it its partitions, again without a rebalance.

What it costs: one more process with the model loaded (a spare holds its engine's memory), and a
static member does not leave the group on a clean stop either: its partitions wait for a spare, a
restart under the same slot, or the session timeout.
Not the consumer (``producers.rollout``) nor which processes run (``rlstream.launcher``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.errors import ConsumeError
from pipeline.log import kv
from pipeline.pidlock import PidLock

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often a spare tries the slot locks."""
RENEW_BUDGET, RENEW_WINDOW_S = 3, 600.0
"""Consumer replacements for a fenced static member (``RolloutSlots.renew_fenced``) allowed within
the window; past them another live process uses the slot's instance id, and the worker exits."""


class RolloutSlots:
    def __init__(self, root: Path, n: int):
        self.root, self.n = Path(root), n
        self.locks = [PidLock(self.root / f"slot-{i}.lock") for i in range(n)]
        self.held: int | None = None
        self._handle = None
        self._renewed_at: list[float] = []

    @classmethod
    def of(cls, cfg) -> RolloutSlots | None:
        """The job's slots (``rollout.slots`` > 0), else None: a dynamic member, as before."""
        n = cfg.rollout.slots
        return cls(slot_root(cfg), n) if n else None

    @staticmethod
    def instance_id(i: int) -> str:
        return f"rollout-slot-{i}"

    def take(self) -> int | None:
        """Take the first free slot and return its index (held until ``release`` or death), or None
        while every slot is held."""
        if self.held is not None:
            return self.held
        for i, lock in enumerate(self.locks):
            handle = lock.try_lock()
            if handle is not None:
                self.held, self._handle = i, handle
                return i
        return None

    def holder(self, i: int) -> int | None:
        """PID of the live process that holds slot ``i`` (None: free)."""
        return self.locks[i].holder()

    def release(self) -> None:
        PidLock.unlock(self._handle)
        self.held = self._handle = None

    def renew_fenced(self, worker, exc: ConsumeError) -> None:
        """The slot's static registration was taken by a consumer with its ``group.instance.id``:
        librdkafka does this to itself after its session expired behind a broker fault (the scale
        chaos run: "partitions lost", then "Static consumer fenced by other consumer with same
        group.instance.id", exit 2). Forget the partitions (their admitted samples are published,
        their prompts are read again by the new member: at-least-once, as after a loss) and replace
        the consumer in place; the new member takes the registration back and reads from the
        committed offsets. Past ``RENEW_BUDGET`` in ``RENEW_WINDOW_S`` another live process uses
        the id: the worker exits with the error."""
        now = time.monotonic()
        self._renewed_at = [t for t in self._renewed_at if now - t < RENEW_WINDOW_S] + [now]
        iid = self.instance_id(self.held)
        if len(self._renewed_at) > RENEW_BUDGET:
            raise ConsumeError(
                f"fenced as the static member {iid} {len(self._renewed_at)} times in {RENEW_WINDOW_S:.0f} s: "
                f"another live process uses group.instance.id={iid!r} (a second job with the same run dir, or "
                f"rollout workers started by hand with rollout.slots) ({exc})",
                exc.kafka_error,
            ) from exc
        log.warning("static member fenced by its own group.instance.id; replacing the consumer %s",
                    kv(worker=worker.worker_id, instance_id=iid, error=exc))  # fmt: skip
        tps = set(worker.consumer.assignment()) | set(worker.commits.ledger.parts)
        worker.commits.forget(tps)
        worker.queue.drop(lambda tp: tp in tps)
        with worker.section("replace consumer", worker.liveness.outage_s + 60):
            worker.consumer.renew()
        worker.metrics.inc("consumers_replaced")


def slot_root(cfg) -> Path:
    """Where the slot locks live: ``<run_dir>/rollout-slots``."""
    return Path(cfg.run_dir) / "rollout-slots"


def spare_once(worker) -> bool:
    """One turn of a spare rollout worker (``RolloutWorker.run_once`` while it has no consumer):
    follow the weights, publish its metrics (a spare is alive, not hung), and join the group under
    the first slot that is free."""
    worker._poll_weights()
    worker._maybe_load()
    worker.metrics.maybe_publish()
    slot = worker.slots.take()
    if slot is None:
        worker.stop_event.wait(POLL_S)
        return True
    log.warning(
        "spare: taking over rollout slot %s", kv(slot=slot, worker=worker.worker_id, version=worker.engine.version)
    )
    with worker.section("take-over", worker.liveness.slow_op_s):
        worker._join()
    worker._last_work = time.monotonic()
    return True
