"""Every policy loss, the k3 KL term and every aggregation against hand-computed values; the loss
mask excludes environment tokens from value and gradient."""

import math

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer import losses  # noqa: E402
from consumers.trainer.batch import MicroBatch, TrainSample, collate, sample_weights, shard_micro_batches  # noqa: E402
from consumers.trainer.loss_config import loss_config  # noqa: E402

LN = math.log


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def grad_of(fn, logp):
    logp = logp.clone().requires_grad_(True)
    out = fn(logp)
    out.sum().backward()
    return out.detach(), logp.grad


def test_ppo_clip_values_and_gradients():
    old = t(0.0, 0.0, 0.0, 0.0)
    logp = t(LN(1.5), LN(1.5), LN(0.5), LN(0.5))
    adv = t(1.0, -1.0, 1.0, -1.0)
    val, g = grad_of(lambda lp: losses.ppo_clip(lp, old, adv, 0.2, 0.2)[0], logp)
    # r=1.5,A=1: -min(1.5, 1.2) = -1.2 (clipped, no grad); r=1.5,A=-1: -min(-1.5,-1.2) = 1.5 (grad -A r = 1.5)
    # r=0.5,A=1: -min(0.5, 0.8) = -0.5 (grad -0.5); r=0.5,A=-1: -min(-0.5,-0.8) = 0.8 (clipped)
    assert val.tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8])
    assert g.tolist() == pytest.approx([0.0, 1.5, -0.5, 0.0])
    # clip-higher: eps_high 0.6 lets r=1.5 through
    assert losses.ppo_clip(logp, old, adv, 0.2, 0.6)[0][0].item() == pytest.approx(-1.5)


def test_tis_values_and_gradients():
    old = t(0.0, 0.0)
    logp = t(LN(3.0), LN(0.5))
    adv = t(1.0, 1.0)
    val, g = grad_of(lambda lp: losses.tis(lp, old, adv, cap=2.0)[0], logp)
    # w = min(3, 2) = 2: -2 * ln 3; w = 0.5: -0.5 * ln 0.5. Gradient -w A (weight detached).
    assert val.tolist() == pytest.approx([-2 * LN(3.0), -0.5 * LN(0.5)])
    assert g.tolist() == pytest.approx([-2.0, -0.5])


def test_cispo_values_and_gradients():
    old = t(0.0, 0.0, 0.0)
    logp = t(LN(6.0), LN(0.5), LN(0.5))
    adv = t(1.0, -2.0, 1.0)
    val, g = grad_of(lambda lp: losses.cispo(lp, old, adv, eps_low=1.0, eps_high=4.0)[0], logp)
    # w = clip(6, 0, 5) = 5; w = 0.5 (no lower clip with eps_low = 1); loss -w A logp, grad -w A
    assert val.tolist() == pytest.approx([-5 * LN(6.0), -0.5 * -2.0 * LN(0.5), -0.5 * LN(0.5)])
    assert g.tolist() == pytest.approx([-5.0, 1.0, -0.5])
    # eps_low 0.2 clips the IS weight below at 0.8
    assert losses.cispo(logp, old, adv, 0.2, 4.0)[0][2].item() == pytest.approx(-0.8 * LN(0.5))


def test_decoupled_ppo_values_and_gradients():
    old = t(0.0, 0.0, 0.0)
    prox = t(LN(2.0), LN(2.0), LN(2.0))  # behaviour weight pi_prox / mu = 2
    logp = t(LN(3.0), LN(3.0), LN(2.0))  # ratio to prox: 1.5, 1.5, 1.0
    adv = t(1.0, -1.0, 1.0)
    val, g = grad_of(lambda lp: losses.decoupled_ppo(lp, old, prox, adv, 0.2, 0.2, cap=5.0)[0], logp)
    # 2 * -min(1.5, 1.2) = -2.4 (clipped); 2 * -min(-1.5, -1.2) = 3.0 (grad 2 * 1.5); 2 * -1 = -2 (grad -2)
    assert val.tolist() == pytest.approx([-2.4, 3.0, -2.0])
    assert g.tolist() == pytest.approx([0.0, 3.0, -2.0])
    # a behaviour weight above the cap removes the token (AReaL), it is not clamped
    capped = losses.decoupled_ppo(logp, old, prox, adv, 0.2, 0.2, cap=1.5)[0]
    assert capped.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        losses.decoupled_ppo(logp, old, None, adv, 0.2, 0.2, cap=5.0)


def test_k3_hand_computed_and_non_negative():
    # logp = ln .5, ref = ln .25: d = ln .5 -> 0.5 - ln 0.5 - 1 = 0.19315
    assert losses.k3(t(LN(0.5)), t(LN(0.25))).item() == pytest.approx(0.5 + LN(2.0) - 1)
    assert losses.k3(t(-1.0), t(-1.0)).item() == 0.0
    assert (losses.k3(torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)) >= 0).all()


def _mb(logp_old, adv, mask, weights, ref=None, prox=None):
    b, n = len(adv), len(logp_old[0])
    return MicroBatch(
        input_ids=torch.zeros(b, n + 1, dtype=torch.long),
        attention_mask=torch.ones(b, n + 1, dtype=torch.long),
        targets=torch.zeros(b, n, dtype=torch.long),
        token_mask=torch.tensor(mask, dtype=torch.float32),
        old_logp=torch.tensor(logp_old, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        weights=torch.tensor(weights, dtype=torch.float32),
        ids=[str(i) for i in range(b)],
        ref_logp=None if ref is None else torch.tensor(ref, dtype=torch.float32),
        prox_logp=None if prox is None else torch.tensor(prox, dtype=torch.float32),
    )


def test_micro_batch_loss_weights_mask_and_kl():
    # two sequences, on-policy (ratio 1): ppo token loss = -A; second seq's last token is masked out
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    mb = _mb([[-1.0, -2.0], [-1.0, -1.0]], [1.0, -2.0], [[1, 1], [1, 0]], [0.25, 0.5])
    loss, stats = losses.micro_batch_loss(logp, mb, loss_config())
    assert loss.item() == pytest.approx(0.25 * (-1 - 1) + 0.5 * 2.0)
    loss.backward()
    assert logp.grad[1, 1].item() == 0.0  # masked token: no gradient
    assert logp.grad[0].tolist() == pytest.approx([-0.25, -0.25])
    assert stats["ratio"] == (pytest.approx(3.0), 3.0)
    # with KL: ref = logp + ln 2 on every token -> k3 = 2 - ln 2 - 1 per token
    ref = [[-1.0 + LN(2), -2.0 + LN(2)], [-1.0 + LN(2), -1.0 + LN(2)]]
    mb_kl = _mb([[-1.0, -2.0], [-1.0, -1.0]], [1.0, -2.0], [[1, 1], [1, 0]], [0.25, 0.5], ref=ref)
    loss_kl, _ = losses.micro_batch_loss(logp.detach(), mb_kl, loss_config(kl_coef=0.1))
    k3 = 2 - LN(2) - 1
    assert loss_kl.item() == pytest.approx(-0.5 + 1.0 + 0.1 * (0.25 * 2 * k3 + 0.5 * k3), rel=1e-5)
    with pytest.raises(ValueError):
        losses.micro_batch_loss(logp.detach(), mb, loss_config(kl_coef=0.1))


def _sample(i, n_resp, mask=None, prompt=(5, 6)):
    return TrainSample(
        trajectory_id=f"g/{i}",
        prompt_group="g",
        partition=0,
        offset=i,
        prompt=list(prompt),
        response=[7 + j for j in range(n_resp)],
        logprobs=[-0.1 * (j + 1) for j in range(n_resp)],
        mask=mask or [1] * n_resp,
        reward=0.0,
        version_min=0,
        version_max=0,
        group_size=2,
    )


@pytest.mark.parametrize(
    ("agg", "norm", "expected"),
    [
        ("token-mean", None, [1 / 6, 1 / 6]),
        ("seq-mean-token-mean", None, [1 / 4, 1 / 8]),
        ("seq-mean-token-sum", None, [1 / 2, 1 / 2]),
        ("seq-mean-token-sum-norm", 10, [1 / 20, 1 / 20]),
        ("seq-mean-token-sum-norm", None, [1 / 10, 1 / 10]),  # L = longest response (5)
    ],
)
def test_aggregation_weights(agg, norm, expected):
    # 2 trained tokens (3 tokens, one environment token) and 4 trained tokens (5 tokens, one env token)
    samples = [_sample(0, 3, [1, 0, 1]), _sample(1, 5, [1, 1, 0, 1, 1])]
    assert sample_weights(samples, loss_config(aggregation=agg, norm_tokens=norm)) == pytest.approx(expected)


def test_sequence_without_trained_tokens_does_not_count():
    samples = [_sample(0, 2, [0, 0]), _sample(1, 4)]
    assert sample_weights(samples, loss_config(aggregation="seq-mean-token-sum")) == [0.0, 1.0]


def test_collate_aligns_response_tokens_and_honours_loss_mask():
    s = _sample(0, 3, [1, 0, 1], prompt=(5, 6))
    mb = collate([s, _sample(1, 1)], [0.5, 0.5])
    # sequence 5 6 | 7 8 9: position 1 predicts 7, 2 predicts 8 (environment token), 3 predicts 9
    assert mb.input_ids[0].tolist() == [5, 6, 7, 8, 9]
    assert mb.targets[0].tolist() == [6, 7, 8, 9]
    assert mb.token_mask[0].tolist() == [0, 1, 0, 1]
    assert mb.old_logp[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3])
    assert mb.attention_mask[1].tolist() == [1, 1, 1, 0, 0] and mb.token_mask[1].tolist() == [0, 1, 0, 0]


def test_shards_cover_every_sample_once_with_equal_micro_batch_counts():
    samples = [_sample(i, 1 + i % 3) for i in range(7)]
    w = [1.0] * 7
    shards = [shard_micro_batches(samples, w, r, 2, 2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 2  # 4 and 3 samples -> 2 micro-batches each
    ids = [i for sh in shards for mb in sh for i in mb.ids]
    assert sorted(ids) == sorted(s.trajectory_id for s in samples)
    dummy = shard_micro_batches([], [], 0, 1, 4)
    assert len(dummy) == 1 and dummy[0].weights.tolist() == [0.0] and dummy[0].ids == []
