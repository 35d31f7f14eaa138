"""Micro-batches: the vectorised ``collate`` builds exactly what the element-by-element version did;
packed micro-batches (one padding-free row, position ids restarting per sample) give the padded
computation's loss and gradients on the tiny model for every loss; micro-batches bounded by a
token budget and optimizer steps bounded by tokens cover every sample once."""

import random

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.batch import TrainSample, sample_weights  # noqa: E402
from consumers.trainer.collate import chunk, collate, pack, shard_micro_batches, split_by_tokens  # noqa: E402
from consumers.trainer.engines import TrainContext, build_engine  # noqa: E402
from consumers.trainer.engines.base import forward_loss  # noqa: E402
from consumers.trainer.losses import LossFn  # noqa: E402
from consumers.trainer.step import train_samples  # noqa: E402
from pipeline.models import materialize  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from tests.test_deepspeed import TINY, assert_close  # noqa: E402


def reference_collate(samples, weights, pad_id=0):
    """The element-by-element collate the trainer used before it was vectorised (kept verbatim
    as the reference the fast one must equal)."""
    t = max(max(len(s.prompt) + len(s.response) for s in samples), 2)
    b = len(samples)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    token_mask = torch.zeros(b, t - 1)
    old = torch.zeros(b, t - 1)
    for i, s in enumerate(samples):
        seq = s.prompt + s.response
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        p = len(s.prompt)
        for j in range(0 if s.prompt else 1, len(s.response)):
            token_mask[i, p + j - 1] = float(s.mask[j])
            old[i, p + j - 1] = s.logprobs[j]
    return input_ids, attn, input_ids[:, 1:].clone(), token_mask, old


def random_samples(n, seed=0, vocab=(4, 80), max_prompt=6, max_resp=9, empty_prompts=True):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(0 if empty_prompts else 1, max_prompt)
        r = rng.randint(1, max_resp)
        out.append(
            TrainSample(
                trajectory_id=f"g{i // 4}/{i}",
                prompt_group=f"g{i // 4}",
                partition=0,
                offset=i,
                prompt=[rng.randrange(*vocab) for _ in range(p)],
                response=[rng.randrange(*vocab) for _ in range(r)],
                logprobs=[-rng.uniform(3.0, 5.0) for _ in range(r)],
                mask=[int(rng.random() < 0.8) for _ in range(r)],
                reward=float(rng.random() < 0.5),
                version_min=0,
                version_max=0,
                group_size=4,
                advantage=rng.uniform(-1.5, 1.5),
            )
        )
    return out


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_collate_equals_the_element_wise_one(seed):
    samples = random_samples(9, seed)
    weights = [random.Random(seed).random() for _ in samples]
    mb = collate(samples, weights, pad_id=3)
    ids, attn, targets, mask, old = reference_collate(samples, weights, pad_id=3)
    for got, want in ((mb.input_ids, ids), (mb.attention_mask, attn), (mb.targets, targets)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for got, want in ((mb.token_mask, mask), (mb.old_logp, old)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert mb.advantages.tolist() == pytest.approx([s.advantage for s in samples])
    assert mb.weights.tolist() == pytest.approx(weights) and mb.ids == [s.trajectory_id for s in samples]
    assert mb.position_ids is None and mb.segments is None


def test_pack_lays_samples_end_to_end():
    a = TrainSample("g/0", "g", 0, 0, [5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], [1, 0, 1], 0.0, 0, 0, 2, advantage=1.0)
    b = TrainSample("g/1", "g", 0, 1, [], [10, 11], [-0.4, -0.5], [1, 1], 0.0, 0, 0, 2, advantage=-1.0)
    mb = pack([a, b], [0.5, 0.25])
    # row: 5 6 7 8 9 | 10 11; positions restart at 0 for the second sample
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    # position 1 predicts 7, 2 predicts 8 (env token), 3 predicts 9; 4 -> 10 crosses samples (masked);
    # b has no prompt, so its first token is not trained; 5 predicts 11
    assert mb.token_mask.tolist() == [[0, 1, 0, 1, 0, 1]]
    assert mb.old_logp[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3, 0, -0.5])
    assert mb.segments.tolist() == [[0, 0, 0, 0, 0, 1]]
    assert mb.per_token(mb.advantages).tolist() == [[1.0] * 5 + [-1.0]]


def setup(*extra):
    cfg = load_config(None, [*TINY, "trainer.lr=0.05", *extra], environ={})
    d = materialize(cfg.model)
    return cfg, build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_packed_loss_and_gradients_equal_the_padded_ones(loss):
    """Same samples, same weights: one padded micro-batch vs one packed row."""
    cfg, eng = setup(f"trainer.loss.type={loss}", "trainer.loss.aggregation=seq-mean-token-mean")
    samples = random_samples(7, seed=11, empty_prompts=False)
    w = sample_weights(samples, cfg.trainer.loss)
    loss_fn = LossFn(cfg.trainer.loss)
    results = []
    for build in (collate, pack):
        mb = build(samples, w, eng.pad_id)
        eng.module.zero_grad(set_to_none=True)
        value, _ = forward_loss(eng.module, mb, loss_fn)
        value.backward()
        grads = {n: p.grad.clone() for n, p in eng.module.named_parameters() if p.grad is not None}
        results.append((float(value.detach()), grads))
    (padded, g_pad), (packed, g_pack) = results
    assert packed == pytest.approx(padded, rel=1e-5, abs=1e-7)
    assert padded != 0.0
    assert g_pad.keys() == g_pack.keys()
    for n in g_pad:
        torch.testing.assert_close(g_pack[n], g_pad[n], rtol=1e-4, atol=1e-6)


def test_a_packed_trainer_step_lands_where_the_padded_one_does():
    samples = random_samples(10, seed=5, empty_prompts=False)
    ends = []
    for extra in ([], ["trainer.packing=true", "trainer.max_tokens_per_micro_batch=40"]):
        cfg, eng = setup("trainer.micro_batch_size=3", *extra)
        out = train_samples(eng, [*samples], cfg.trainer, LossFn(cfg.trainer.loss), 1)
        ends.append((out["loss"], eng.state_dict()))
    assert ends[1][0] == pytest.approx(ends[0][0], rel=1e-5)
    assert_close(ends[0][1], ends[1][1], atol=1e-4, rtol=1e-3)  # Adam amplifies float noise on ~0 gradients


def test_token_budget_micro_batches():
    samples = random_samples(11, seed=3)
    lens = sorted(len(s.prompt) + len(s.response) for s in samples)
    items = [(s, 1.0) for s in sorted(samples, key=lambda s: len(s.prompt) + len(s.response))]
    for packing in (False, True):
        cut = chunk(items, 99, 24, packing)
        assert [s for c in cut for s, _ in c] == [s for s, _ in items]  # every sample once, in order
        for c in cut:
            n = [len(s.prompt) + len(s.response) for s, _ in c]
            cost = sum(n) if packing else len(n) * max(n)
            assert cost <= 24 or len(c) == 1
    # hand-computed: lengths 3, 4, 5, 9 with a budget of 10 -> padded [3, 4] (2x4=8), [5] ([5, 9] = 18), [9];
    # packed [3, 4] (7), [5] (5 + 9 > 10), [9]
    four = [(TrainSample(f"s{n}", "g", 0, n, [1], [2] * (n - 1), [0.0] * (n - 1), [1] * (n - 1), 0.0, 0, 0, 1), 1.0)
            for n in (3, 4, 5, 9)]  # fmt: skip
    sizes = lambda cut: [[len(s.prompt) + len(s.response) for s, _ in c] for c in cut]  # noqa: E731
    assert sizes(chunk(four, 99, 10, False)) == [[3, 4], [5], [9]]
    assert sizes(chunk(four, 99, 10, True)) == [[3, 4], [5], [9]]
    assert sizes(chunk(four, 99, 12, True)) == [[3, 4, 5], [9]]
    assert sizes(chunk(four, 99, 12, False)) == [[3, 4], [5], [9]]  # 3 rows x 5 = 15 > 12
    assert lens  # the random ones exist
    # every rank gets the same number of micro-batches, dummies included
    shards = [shard_micro_batches(samples, [1.0] * 11, r, 2, 8, max_tokens=20, packing=True) for r in range(2)]
    assert len(shards[0]) == len(shards[1])
    assert sorted(i for sh in shards for mb in sh for i in mb.ids) == sorted(s.trajectory_id for s in samples)


def test_max_tokens_per_step_splits_optimizer_steps():
    samples = random_samples(8, seed=9, empty_prompts=False)
    total = sum(len(s.prompt) + len(s.response) for s in samples)
    parts = split_by_tokens(samples, total // 3)
    assert [s for p in parts for s in p] == samples and len(parts) >= 3
    assert all(sum(len(s.prompt) + len(s.response) for s in p) <= total // 3 or len(p) == 1 for p in parts)
    cfg, eng = setup(f"trainer.max_tokens_per_step={total // 3}")
    out = train_samples(eng, samples, cfg.trainer, LossFn(cfg.trainer.loss), 1)
    assert out["optimizer_steps"] == len(parts)


def test_packing_is_refused_for_an_attention_without_position_id_separation():
    from consumers.trainer.worker import check_packing
    from pipeline.errors import ConfigError

    class Conf:
        _attn_implementation = "paged|my_kernel"

    with pytest.raises(ConfigError, match="packing"):
        check_packing(Conf())
    _, eng = setup()
    check_packing(eng.model_config)  # the tiny Llama (sdpa) supports it
