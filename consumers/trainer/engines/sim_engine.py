"""The ``sim`` train engine: a load generator that stands in for a GPU trainer. It is NOT a trainer.

``train_step`` sleeps ``token_cost_s`` per (prompt + response) token of its micro-batches and
changes no weight; ``state_dict`` returns the unchanged initial model, so WeightUpdates still name
real, verifiable checkpoints. Everything around it (consumer, group assembly, staleness gate,
checkpoints, notices, metrics) is the real trainer, which is what benchmarks of the pipeline's
scheduling measure. One process only (``multi_process = False``). Not the rollout side's ``sim``
engine (``libs.engines.sim``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from consumers.trainer.engines.base import TrainContext, TrainEngine, TrainStepResult, dist_env
from pipeline.models import load_model


class SimTrainEngine(TrainEngine):
    multi_process = False

    def __init__(self, config, ctx: TrainContext):
        trainer_cfg, model_dir = ctx.trainer, ctx.model_dir
        self.config, self.cfg = config, trainer_cfg
        self.rank, self.world_size, _ = dist_env()
        self.module = load_model(model_dir, device="cpu")
        self.model_config = self.module.config
        self.tokens = 0
        self.steps = 0

    @property
    def lr(self) -> float:
        return float(self.cfg.lr)

    def train_step(self, micro_batches, loss_fn, capture_grads: bool = False) -> TrainStepResult:
        tokens = sum(int(mb.attention_mask.sum()) for mb in micro_batches if mb.ids)
        time.sleep(self.config.token_cost_s * tokens)
        self.tokens += tokens
        self.steps += 1
        return TrainStepResult(loss=0.0, grad_norm=0.0, lr=self.lr, stats={}, grads={} if capture_grads else None)

    def compute_logprobs(self, micro_batches) -> list:
        return [mb.old_logp.clone() for mb in micro_batches]  # the behaviour policy stands in

    def state_dict(self) -> dict | None:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def save(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "sim.json").write_text(json.dumps({"steps": self.steps, "tokens": self.tokens}))

    def load(self, path: Path) -> None:
        state = json.loads((Path(path) / "sim.json").read_text())
        self.steps, self.tokens = state["steps"], state["tokens"]
