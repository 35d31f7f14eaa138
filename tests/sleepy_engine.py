"""A train engine plug-in for tests (``type = "tests.sleepy_engine:SleepyEngine"``): the torch engine
on the CPU whose every optimizer step first sleeps ``options.sleep_s`` seconds, spread over its
micro-batches, as a large model's long step would take."""

from __future__ import annotations

import time

from consumers.trainer.config import TorchEngineConfig
from consumers.trainer.engines.torch_engine import TorchEngine


class SleepyEngine(TorchEngine):
    def __init__(self, config, ctx):
        super().__init__(TorchEngineConfig(device="cpu"), ctx)
        self.sleep_s = float(config.options.get("sleep_s", 90.0))

    def train_step(self, micro_batches, loss_fn, capture_grads: bool = False):
        n = max(1, len(micro_batches))
        for _ in micro_batches:  # (the trainer counts the micro-batches as they are gone through)
            time.sleep(self.sleep_s / n)
        return super().train_step(micro_batches, loss_fn, capture_grads)
