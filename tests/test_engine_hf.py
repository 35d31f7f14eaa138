"""The hf engine: continuous batching, exact behaviour logprobs, abort, in-place weight loads."""

import pytest
import torch

from libs.engines import EngineContext
from libs.engines.base import GenRequest
from libs.engines.hf import HFEngine
from pipeline.models import TinyModelConfig, load_model, load_tokenizer, materialize
from producers.config import HFEngineConfig
from tests.rollout_helpers import forcing_state_dict


@pytest.fixture(scope="module")
def tiny():
    d = materialize(TinyModelConfig())
    return d, load_tokenizer(d), load_model(d)


def teacher_forced_logprobs(model, context, tokens, temperature=1.0):
    ids = torch.tensor([context + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)[len(context) - 1 : len(context) - 1 + len(tokens)]
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def reqs(tok, n, base=20, temperature=1.0):
    texts = ["Copy: apple\n", "hi", "Guess my number", "x", "The quick brown fox", "0123456789"]
    return [
        GenRequest(f"r{i}", tok.encode(texts[i % len(texts)]), base + 5 * i, temperature, frozenset({tok.eos_token_id}))
        for i in range(n)
    ]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_forward_pass_under_continuous_batching(tiny, temperature):
    d, tok, model = tiny
    eng = HFEngine(HFEngineConfig(refill_every=3), EngineContext(d, tok, "w"))
    rs = reqs(tok, 6, temperature=temperature)
    for r in rs[:2]:
        eng.submit(r)
    outs, steps = [], 0
    while eng.inflight() or steps < 8:
        if steps == 4:  # requests arriving while others run join the running batch
            for r in rs[2:]:
                eng.submit(r)
        outs += eng.step()
        steps += 1
    assert sorted(o.rid for o in outs) == sorted(r.rid for r in rs)
    by = {r.rid: r for r in rs}
    for o in outs:
        r = by[o.rid]
        assert len(o.tokens) == len(o.logprobs) >= 1
        assert o.finish_reason == ("stop" if o.tokens[-1] == tok.eos_token_id else "length")
        assert o.finish_reason == "stop" or len(o.tokens) == r.max_new_tokens
        ref = teacher_forced_logprobs(model, r.context, o.tokens, temperature)
        assert torch.allclose(ref, torch.tensor(o.logprobs), atol=1e-4), (
            o.rid,
            (ref - torch.tensor(o.logprobs)).abs().max(),
        )


def test_finished_samples_come_back_before_slow_ones(tiny):
    d, tok, _ = tiny
    eng = HFEngine(HFEngineConfig(), EngineContext(d, tok, "w"))
    short = GenRequest("short", tok.encode("a"), 3, 1.0, frozenset())
    long = GenRequest("long", tok.encode("b"), 60, 1.0, frozenset())
    eng.submit(long)
    eng.submit(short)
    first = []
    while not first:
        first = eng.step()
    assert [o.rid for o in first] == ["short"] and eng.inflight() == 1


def test_greedy_is_deterministic_and_abort_returns_partials(tiny):
    d, tok, _ = tiny
    eng = HFEngine(HFEngineConfig(), EngineContext(d, tok, "w"))
    r = GenRequest("g", tok.encode("hello"), 30, 0.0, frozenset())
    a = eng.generate([r])[0]
    b = eng.generate([GenRequest("g2", r.context, 30, 0.0, frozenset())])[0]
    assert a.tokens == b.tokens and a.finish_reason == "length"
    eng.submit(GenRequest("p", tok.encode("hello"), 100, 0.0, frozenset()))
    for _ in range(6):
        eng.step()
    (part,) = eng.abort()
    assert part.finish_reason == "abort" and 1 <= len(part.tokens) < 100 and part.tokens == a.tokens[: len(part.tokens)]
    assert eng.inflight() == 0


def test_load_weights_changes_generation(tiny):
    d, tok, model = tiny
    eng = HFEngine(HFEngineConfig(), EngineContext(d, tok, "w"))
    z = tok.convert_tokens_to_ids("Z")
    before = eng.generate(reqs(tok, 3))
    assert not all(set(o.tokens) == {z} for o in before)
    eng.submit(GenRequest("busy", [5], 5, 1.0, frozenset()))
    with pytest.raises(RuntimeError):
        eng.load_weights({"version": 1, "uri": "x"}, model.state_dict())
    eng.abort()
    eng.load_weights({"version": 1, "uri": "x"}, forcing_state_dict(model.state_dict(), z))
    after = eng.generate(reqs(tok, 3))
    assert eng.version == 1 and all(set(o.tokens) == {z} for o in after)
    assert all(lp > -1e-3 for o in after for lp in o.logprobs)
