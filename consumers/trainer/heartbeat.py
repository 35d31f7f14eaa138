"""Where the trainer is inside a step, said on rl.metrics while the step runs.

A step of a large model can take minutes (a 7B model on one GPU, a 135M model on a CPU: 80 s). While
one runs, ``StepHeartbeat`` publishes a MetricEvent every ``trainer.metrics_interval_s`` from a
background thread: the worker's last metrics plus ``busy_step`` (the step being trained),
``busy_since_ms`` (when it began), ``micro_batch`` / ``micro_batches`` (i of n of the current
optimizer step), ``minibatch`` / ``minibatches``, and the label ``phase`` (one of ``PHASES``). The
launcher (``rlstream.stall``) tells such a trainer, busy, from one that says nothing, stalled; its
hang check sees the events too.

Cheap: the step loop only sets fields (a phase change, one call per micro-batch); nothing is sent
per token or per micro-batch. Not a watchdog: a step blocked inside one call still says the same
phase and micro-batch, with a growing time, which is what the user sees.
"""

from __future__ import annotations

import logging
import threading

from pipeline.control import now_ms
from pipeline.log import kv

log = logging.getLogger(__name__)

PHASES = ("assembling", "logprobs", "forward-backward", "optimizer", "checkpoint", "publishing weights")
"""What a trainer step does, in order (``logprobs``: the proximal/reference log-probabilities).
Between steps (waiting for samples) the trainer is not busy and sends its periodic events only."""


class StepHeartbeat:
    """Rank 0's in-step progress (see the module docstring). ``metrics``: the worker's
    ``WorkerMetrics``; ``producer``: a producer of this thread's own (the worker's stays with the
    step loop, which alone sees its delivery errors); ``interval_s``: seconds between two events
    while a step runs."""

    def __init__(self, metrics, producer, interval_s: float):
        self.metrics, self.producer, self.interval_s = metrics, producer, interval_s
        self._lock = threading.Lock()
        self._state: dict | None = None  # None: between steps
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- the step loop ---------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step ``step`` (1-based: the one being trained) begins."""
        with self._lock:
            self._state = {"busy_step": float(step), "busy_since_ms": float(now_ms()), "phase": "assembling",
                           "minibatch": 0.0, "minibatches": 0.0, "micro_batch": 0.0, "micro_batches": 0.0}  # fmt: skip
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trainer-heartbeat", daemon=True)
            self._thread.start()

    def phase(self, name: str) -> None:
        with self._lock:
            if self._state is not None:
                self._state["phase"] = name

    def minibatch(self, i: int, n: int) -> None:
        """Optimizer step ``i`` (1-based) of ``n`` of this trainer step begins."""
        with self._lock:
            if self._state is not None:
                self._state.update(phase="forward-backward", minibatch=float(i), minibatches=float(n),
                                   micro_batch=0.0)  # fmt: skip

    def micro_batch(self, i: int, n: int) -> None:
        with self._lock:
            if self._state is not None:
                self._state.update(micro_batch=float(i), micro_batches=float(n))

    def end(self) -> None:
        with self._lock:
            self._state = None

    def counted(self, micro_batches: list) -> list:
        """``micro_batches`` as a list that reports each one as an engine iterates over it, and the
        optimizer phase once it has gone through them all."""
        return _Counted(micro_batches, self)

    def close(self) -> None:
        """Stop the thread and let the producer go (a progress event still queued is dropped)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 5)
        try:
            self.producer.close(timeout=2.0)
        except Exception as exc:  # progress events only
            log.info("in-step progress events not all sent %s", kv(error=exc))

    # -- the thread ------------------------------------------------------------------------------
    def fields(self) -> tuple[dict, dict] | None:
        """(metrics, labels) of the in-step event now, None between steps."""
        with self._lock:
            if self._state is None:
                return None
            state = dict(self._state)
        phase = state.pop("phase")
        return state, {"phase": phase}

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._closed:
                return
            now = self.fields()
            if now is None:
                continue
            try:
                self.metrics.publish_extra(*now, producer=self.producer)
                self.producer.poll(0)
            except Exception as exc:  # a lost progress event is a display matter; the step goes on
                log.warning("in-step progress event not sent %s", kv(error=exc))


class _Counted(list):
    def __init__(self, items, beat: StepHeartbeat):
        super().__init__(items)
        self._beat = beat

    def __iter__(self):
        n = len(self)
        for i, mb in enumerate(list.__iter__(self)):
            self._beat.micro_batch(i + 1, n)
            yield mb
        self._beat.phase("optimizer")
