"""A LoRA adapter through the openai engine's reload (``reload = "post"``) into a real
OpenAI-compatible server on 127.0.0.1 (producers.openai_server over the hf engine): the server
applies the announced adapter, and greedy generation then equals the hf engine's with the same
adapter applied locally."""

import pytest

pytest.importorskip("peft")

from consumers.trainer.engines import TrainContext, build_engine
from consumers.trainer.losses import LossFn
from consumers.trainer.publish import write_version
from consumers.trainer.step import train_samples
from libs.engines import EngineContext
from libs.engines.base import GenRequest
from libs.engines.hf import HFEngine
from libs.engines.openai import OpenAIEngine, reload_body
from pipeline.checkpoint import model_fingerprint
from pipeline.models import load_tokenizer, materialize
from producers.config import HFEngineConfig, OpenAIEngineConfig
from producers.openai_server import CompletionServer
from rlstream.config import load_config
from tests.test_deepspeed import TINY, make_samples


def test_the_server_applies_the_announced_adapter(tmp_path):
    cfg = load_config(None, [*TINY, "trainer.lr=0.2", "trainer.micro_batch_size=4", "trainer.lora.rank=4"], environ={})
    d = materialize(cfg.model)
    trainer = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    for i in range(4):
        train_samples(trainer, make_samples(5), cfg.trainer, LossFn(cfg.trainer.loss), i)
    upd = write_version(trainer, trainer.state_dict(), str(tmp_path), 1, 4, cfg.trainer, 4, model_fingerprint(d))
    body = reload_body(upd)
    assert (
        body["kind"] == "adapter" and body["adapter_rank"] == 4 and body["adapter_dir"] == str(tmp_path / "v00000001")
    )

    tok = load_tokenizer(d)
    srv = CompletionServer(d).start()
    try:
        remote = OpenAIEngine(OpenAIEngineConfig(base_url=srv.base_url), EngineContext(None, tok))
        local = HFEngine(HFEngineConfig(), EngineContext(d, tok, "w"))
        reqs = [GenRequest(f"r{i}", tok.encode(t), 12, 0.0, frozenset()) for i, t in enumerate(["ab", "hello", "9>"])]
        before = [o.tokens for o in remote.generate(reqs)]
        remote.load_weights(upd, remote.prepare_weights(upd))
        local.load_weights(upd, local.prepare_weights(upd))
        again = [GenRequest(f"x{r.rid}", r.context, r.max_new_tokens, 0.0, frozenset()) for r in reqs]
        after = [o.tokens for o in remote.generate(again)]
        assert srv.engine.version == 1 and remote.version == 1
        assert after == [o.tokens for o in local.generate(again)]  # the server holds the adapter
        assert after != before  # and it changed what the model says
        remote.close()
    finally:
        srv.stop()
