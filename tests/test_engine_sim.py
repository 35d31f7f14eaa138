"""The ``sim`` rollout engine (a load generator): its timing model, its length distribution, and that
an interrupted sample resumes to the same total length."""

import time

from libs.engines import EngineContext
from libs.engines.base import GenRequest
from libs.engines.sim import SimEngine, expected_length, sample_length
from producers.config import SimEngineConfig


class Tok:
    def __len__(self):
        return 100


EOS = frozenset({2})


def test_lengths_are_deterministic_clipped_and_long_tailed():
    cfg = SimEngineConfig(median_tokens=20, sigma=0.5, clip_tokens=160, long_fraction=0.05)
    lens = [sample_length(cfg, f"g{i}/0", 1000) for i in range(4000)]
    assert lens == [sample_length(cfg, f"g{i}/0", 1000) for i in range(4000)]
    assert min(lens) >= 1 and max(lens) == 160
    assert 0.04 < sum(n == 160 for n in lens) / len(lens) < 0.07  # the long fraction, at the clip
    assert sorted(lens)[len(lens) // 2] in range(17, 24)  # the median
    assert max(sample_length(cfg, f"g{i}/0", 50) for i in range(200)) == 50  # the request's budget clips
    assert abs(expected_length(cfg, 1000, 20_000) - sum(lens) / len(lens)) < 2


def test_continuous_batching_time_model():
    cfg = SimEngineConfig(token_latency_s=0.005, median_tokens=40, sigma=0.0)
    eng = SimEngine(cfg, EngineContext(None, Tok(), "w"))
    t0 = time.monotonic()
    outs = eng.generate([GenRequest(f"g{i}/0#1", [1, 3], 1000, 1.0, EOS) for i in range(32)])
    took = time.monotonic() - t0
    assert all(len(o.tokens) == 40 and len(o.logprobs) == 40 and o.finish_reason == "stop" for o in outs)
    assert all(o.tokens[-1] == 2 and 2 not in o.tokens[:-1] for o in outs)
    # 40 decode steps of 5 ms for the whole batch (0.2 s quiet), not 32 x 40 one at a time (6.4 s): the
    # bound is the serial time, not a speed target (a loaded machine stretches every step)
    assert 0.19 <= took < 6.0
    assert eng.inflight() == 0

    capped = SimEngine(
        SimEngineConfig(token_latency_s=0.005, median_tokens=40, sigma=0.0, max_batch=16),
        EngineContext(None, Tok(), "w"),
    )
    t0 = time.monotonic()
    capped.generate([GenRequest(f"g{i}/0#1", [1], 1000, 1.0, EOS) for i in range(32)])
    assert time.monotonic() - t0 >= 0.39  # two waves of 16


def test_interrupted_sample_resumes_to_the_same_length():
    cfg = SimEngineConfig(token_latency_s=0.002, median_tokens=100, sigma=0.0)
    eng = SimEngine(cfg, EngineContext(None, Tok(), "w"))
    tokens, finish = [], "abort"
    for attempt in range(1, 20):
        eng.submit(GenRequest(f"gx/0#{attempt}", [1, *tokens], 1000 - len(tokens), 1.0, EOS))
        time.sleep(0.03)
        outs = eng.step() + eng.abort()
        assert len(outs) == 1
        tokens += outs[0].tokens
        finish = outs[0].finish_reason
        if finish != "abort":
            break
    assert attempt >= 3 and finish == "stop" and len(tokens) == 100


def test_length_finish_and_weights():
    cfg = SimEngineConfig(token_latency_s=0.001, median_tokens=50, sigma=0.0, verify_weights=False)
    eng = SimEngine(cfg, EngineContext(None, Tok(), "w"))
    (out,) = eng.generate([GenRequest("g/0#1", [1], 10, 1.0, EOS)])
    assert out.finish_reason == "length" and len(out.tokens) == 10
    eng.load_weights({"version": 3}, eng.prepare_weights({"version": 3, "uri": "x", "sha256": "y"}))
    assert eng.version == 3
