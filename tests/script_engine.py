"""A rollout engine plug-in for tests (``type = "tests.script_engine:ScriptEngine"``): each model
turn of a sample is the next text of ``options.turns`` (the last one repeats), tokenized and ended
with EOS, cut at the first of the request's stop tokens and at its token budget, as a real engine
would. Logprobs are 0. It loads any weights (it has none)."""

from __future__ import annotations

import time

from libs.engines.base import Engine, GenOutput, GenRequest


class ScriptEngine(Engine):
    name = "script"
    max_model_len = 8192

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.turns = list(config.options["turns"])
        self.pending: list[GenRequest] = []

    def _turn(self, req: GenRequest) -> list[int]:
        n = int(req.rid.rsplit("#", 1)[1]) - 1  # the worker's request ids count the sample's turns
        tok = self.ctx.tokenizer
        ids = [*tok(self.turns[min(n, len(self.turns) - 1)], add_special_tokens=False).input_ids, tok.eos_token_id]
        end = next((i + 1 for i, t in enumerate(ids) if t in req.stop_ids), len(ids))
        return ids[: min(end, req.max_new_tokens)]

    def submit(self, req: GenRequest) -> None:
        self.pending.append(req)

    def step(self, timeout: float = 0.0) -> list[GenOutput]:
        out = []
        for req in self.pending:
            ids = self._turn(req)
            out.append(GenOutput(req.rid, ids, [0.0] * len(ids), "stop"))
        self.pending = []
        if not out and timeout:
            time.sleep(min(timeout, 0.01))
        return out

    def abort(self, rids=None) -> list[GenOutput]:
        gone = [r for r in self.pending if rids is None or r.rid in rids]
        self.pending = [r for r in self.pending if r not in gone]
        return [GenOutput(r.rid, [], [], "abort") for r in gone]

    def inflight(self) -> int:
        return len(self.pending)

    def load_weights(self, update: dict, prepared) -> None:
        self.version = update["version"]
