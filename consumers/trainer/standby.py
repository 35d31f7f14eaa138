"""The hot-standby trainer (``trainer.standby``; ``job.trainer_standby`` runs one beside the
trainer): a second trainer process that waits, with everything imported, on the checkpoint dir's
lock and takes over the moment the holder dies (the OS frees an ``flock`` on kill -9 too),
restoring the newest checkpoint as any restart does. What it saves is the process start: imports
took 7-30 s of a trainer restart on a loaded 2-core machine, and the first engine build another 15 s
of lazy transformers imports (``warm``). It holds no device memory while it waits.

Not the lock itself (``state.TrainerCheckpoints``) nor which processes run (``rlstream.launcher``).
"""

from __future__ import annotations

import logging
import time

from pipeline.errors import CheckpointDamaged
from pipeline.log import kv
from pipeline.models import materialize
from pipeline.worker import StopRequested

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a standby tries the lock."""


def wait_for_lock(trainer):
    """The checkpoint dir's lock handle once this process may train: at once if nobody holds it,
    else after the holder died (warmed up meanwhile). While it waits it beats the watchdog and ends
    on a stop (``StopRequested``). A lock freed because the trainer finished its run
    (``trainer.max_steps`` reached) is nothing to take over: ``StopRequested`` too, a clean exit."""
    ckpts, t0, waited = trainer.ckpts, time.monotonic(), False
    while (lock := ckpts.try_lock()) is None:
        if not waited:
            warm(trainer)
            log.info("standby: another trainer holds the checkpoint dir; waiting to take over %s",
                     kv(dir=ckpts.root, holder=ckpts.holder()))  # fmt: skip
            waited = True
        trainer.beat()
        if trainer.stop_event.wait(POLL_S):
            raise StopRequested("stop while on standby")
    if not waited:
        return lock
    try:
        done = bool(trainer.max_steps) and int((ckpts.read_pointer() or {}).get("step", 0)) >= trainer.max_steps
    except (CheckpointDamaged, ValueError):
        done = False  # the set-up's restore deals with it
    if done:  # the caller's close() frees the lock
        trainer._lock = lock
        log.info("standby: the trainer reached trainer.max_steps; nothing to take over %s", kv(dir=ckpts.root))
        raise StopRequested("the trainer finished")
    log.warning(
        "standby: taking over the checkpoint dir %s", kv(dir=ckpts.root, waited_s=round(time.monotonic() - t0, 1))
    )
    return lock


def warm(trainer) -> None:
    """A standby's head start: the model directory and the modules its first engine build would
    import lazily (transformers' auto classes and the model's own module: 15 s of an 18 s build at
    load 9 on two cores). Weights are not loaded: no device memory is held while waiting."""
    trainer._in_setup = True  # a SIGTERM ends it at once (StopRequested), as in the set-up
    try:
        with trainer.section("standby warm-up", trainer.liveness.slow_op_s):  # the imports are the slow part
            from transformers import AutoConfig
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            model_dir = materialize(trainer.cfg.model)  # safe beside the active trainer's call
            _ = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]
    except Exception as exc:  # only a head start: the take-over does it all again anyway
        log.warning("standby: could not warm up; the take-over imports it all %s", kv(error=exc))
    finally:
        trainer._in_setup = False
