"""Training options against hand-computed values: GSPO (sequence-level ratio and clipping, equal to
the sequence objective's gradient), the entropy bonus, warmup + linear/cosine LR decay, overlong
filtering, the soft overlong length penalty reward, dynamic sampling's group test, and admission
counted from the trainer's consumed groups."""

import math

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer import losses  # noqa: E402
from consumers.trainer.assembler import GroupAssembler  # noqa: E402
from consumers.trainer.batch import MicroBatch, TrainSample, informative, plan_step, sample_weights  # noqa: E402
from consumers.trainer.config import OptimConfig  # noqa: E402
from consumers.trainer.engines.base import lr_lambda, token_logprobs  # noqa: E402
from consumers.trainer.loss_config import advantage_config, loss_config  # noqa: E402
from pipeline import control  # noqa: E402

LN = math.log


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gspo_sequence_ratio_and_clipping_hand_computed():
    old = t([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])
    logp = t([LN(1.1), LN(1.1)], [LN(4.0), 0.0], [LN(4.0), 0.0], [LN(2.0), LN(100.0)]).requires_grad_(True)
    mask = t([1, 1], [1, 1], [1, 1], [1, 0])  # the last sequence's second token is not trained
    adv = t([1.0], [1.0], [-1.0], [-1.0])
    loss, stats = losses.gspo(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # s = exp(mean log ratio): 1.1; exp((ln 4 + 0)/2) = 2; 2; exp(ln 2) = 2 (masked token ignored)
    assert stats["ratio"][:, 0].tolist() == pytest.approx([1.1, 2.0, 2.0, 2.0])
    # A=1, s=1.1: -1.1 (inside the clip); A=1, s=2: -min(2, 1.2) = -1.2 (clipped: no gradient);
    # A=-1, s=2: -min(-2, -1.2) = 2 (not clipped: gradient -A s = 2 per trained token)
    assert loss.detach()[:3].tolist() == [
        pytest.approx([-1.1, -1.1]),
        pytest.approx([-1.2, -1.2]),
        pytest.approx([2.0, 2.0]),
    ]
    (loss * mask).sum().backward()
    assert logp.grad.tolist() == [
        pytest.approx([-1.1, -1.1]),
        [0.0, 0.0],
        pytest.approx([2.0, 2.0]),
        pytest.approx([2.0, 0.0]),
    ]


def test_gspo_token_form_has_the_sequence_objectives_gradient():
    """Under seq-mean-token-mean, sum_i w_i sum_t l_it equals mean_i -min(s_i A_i, clip(s_i) A_i) with
    s_i = exp(mean_t(logp - old)) differentiated as a whole (GSPO's sequence-level objective)."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    logp0 = old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.05
    mask = t([1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0])
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    cfg = loss_config(type="gspo", aggregation="seq-mean-token-mean", eps_low=0.02, eps_high=0.03)
    n = mask.sum(-1)
    mb = MicroBatch(
        input_ids=None, attention_mask=None, targets=None, token_mask=mask, old_logp=old, advantages=adv,
        weights=1.0 / (3 * n), ids=["a", "b", "c"],
    )  # fmt: skip
    a = logp0.clone().requires_grad_(True)
    tok_loss, _ = losses.micro_batch_loss(a, mb, cfg)
    tok_loss.backward()
    b = logp0.clone().requires_grad_(True)
    s = torch.exp(((b - old) * mask).sum(-1) / n)
    seq_loss = (-torch.minimum(s * adv, torch.clamp(s, 0.98, 1.03) * adv)).mean()
    seq_loss.backward()
    assert float(tok_loss.detach()) == pytest.approx(float(seq_loss.detach()), rel=1e-12)
    torch.testing.assert_close(a.grad, b.grad)


def test_gspo_on_packed_segments_equals_rows():
    old = t([0.0, 0.0, 0.0, 0.0, 0.0])
    logp = t([LN(1.1), LN(1.1), LN(4.0), 0.0, 0.0])
    mask = t([1, 1, 1, 1, 0])
    seg = torch.tensor([[0, 0, 1, 1, 1]])
    s = losses.gspo(logp, old, torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64), mask, 0.2, 0.2, seg)
    assert s[1]["ratio"][0, :4].tolist() == pytest.approx([1.1, 1.1, 2.0, 2.0])


def test_entropy_bonus_hand_computed():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mb = MicroBatch(
        input_ids=None, attention_mask=None, targets=None, token_mask=torch.tensor([[1.0, 1.0]]),
        old_logp=torch.tensor([[-1.0, -2.0]]), advantages=torch.tensor([1.0]), weights=torch.tensor([0.5]), ids=["a"],
    )  # fmt: skip
    ent = torch.tensor([[LN(2.0), LN(4.0)]])
    loss, stats = losses.micro_batch_loss(logp, mb, loss_config(entropy_coef=0.1), entropy=ent)
    # on-policy ppo: -A per token = -1; minus 0.1 H: 0.5 * ((-1 - 0.1 ln 2) + (-1 - 0.1 ln 4))
    assert float(loss.detach()) == pytest.approx(0.5 * (-2 - 0.1 * LN(2.0) - 0.1 * LN(4.0)))
    assert stats["entropy"] == (pytest.approx(LN(2.0) + LN(4.0)), 2.0)
    with pytest.raises(ValueError, match="entropy"):
        losses.micro_batch_loss(logp, mb, loss_config(entropy_coef=0.1))
    assert losses.LossFn(loss_config(entropy_coef=0.1)).needs_entropy and not losses.LossFn(loss_config()).needs_entropy


def test_token_entropy_from_a_real_model_matches_the_distribution():
    from consumers.trainer.collate import collate
    from pipeline.models import TinyModelConfig, load_model, materialize

    model = load_model(materialize(TinyModelConfig(hidden_size=32, num_heads=2, num_layers=1, intermediate_size=64)))
    s = TrainSample("g/0", "g", 0, 0, [5, 6, 7], [8, 9], [-1.0, -1.0], [1, 1], 0.0, 0, 0, 1)
    mb = collate([s], [1.0])
    with torch.no_grad():
        logp, ent = token_logprobs(model, mb, entropy=True)
        logits = model(input_ids=mb.input_ids).logits[:, :-1].float()
    want = torch.distributions.Categorical(logits=logits).entropy()
    trained = mb.token_mask > 0  # positions before the first trained one get no logits (token_logprobs)
    torch.testing.assert_close(ent[trained], want[trained], rtol=1e-5, atol=1e-5)
    assert (ent[:, : int(trained[0].nonzero()[0])] == 0).all()
    assert float(ent.max()) <= math.log(logits.shape[-1]) + 1e-5  # at most uniform
    torch.testing.assert_close(logp, token_logprobs(model, mb))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # warmup 2 (0.5, 1.0), then p = (step - 2) / (6 - 2), floor 0.1
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]),
        (
            "cosine",
            [
                0.5,
                1.0,
                1.0,
                0.1 + 0.45 * (1 + math.cos(math.pi / 4)),
                0.55,
                0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4)),
                0.1,
                0.1,
            ],
        ),
    ],
)
def test_lr_schedules_hand_computed(kind, expected):
    f = lr_lambda(OptimConfig(warmup_steps=2, lr_schedule=kind, min_lr_ratio=0.1), decay_steps=6)
    assert [f(s) for s in range(8)] == pytest.approx(expected)


def test_torch_engine_follows_the_cosine_schedule_and_config_is_checked():
    from consumers.trainer.engines import TrainContext, build_engine
    from consumers.trainer.step import train_samples
    from pipeline.errors import ConfigError
    from pipeline.models import materialize
    from rlstream.config import load_config
    from tests.test_deepspeed import TINY, make_samples

    sets = [*TINY, "trainer.lr=0.01", "trainer.optim.lr_schedule=cosine", "trainer.max_steps=4"]
    cfg = load_config(None, sets, environ={})
    eng = build_engine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
    lrs = [train_samples(eng, make_samples(4), cfg.trainer, losses.LossFn(cfg.trainer.loss), i)["lr"] for i in range(5)]
    # the lr reported after update s is the next step's: factor(s + 1) over decay_steps = 4
    # cos(pi s / 4) for s = 1..4, then the floor (0) once p is clamped at 1
    assert lrs == pytest.approx([0.01 * 0.5 * (1 + math.cos(math.pi * min(s, 4) / 4)) for s in range(1, 6)])
    with pytest.raises(ConfigError, match="decay_steps"):
        load_config(None, [*TINY, "trainer.optim.lr_schedule=linear"], environ={})


def _sample(i, reward, finish="stop", vmin=0, group="g"):
    return TrainSample(f"{group}/{i}", group, 0, i, [5], [6, 7], [-1.0, -1.0], [1, 1], reward, vmin, vmin, 4,
                  group_seq=0, finish_reason=finish)  # fmt: skip


class G:
    def __init__(self, samples, complete=True):
        self.samples, self.complete = samples, complete


def test_overlong_filter_keeps_truncated_samples_in_the_baseline_only():
    group = G([_sample(0, 1.0), _sample(1, 0.0, "length"), _sample(2, 0.0), _sample(3, 1.0, "length")])
    plan = plan_step([group], 0, 1, "drop", advantage_config(), overlong_filter=True)
    # grpo over all four rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866
    assert [s.trajectory_id for s in plan.train] == ["g/0", "g/2"]
    assert [s.trajectory_id for s in plan.overlong] == ["g/1", "g/3"]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [s.advantage for s in plan.train] == pytest.approx([a, -a])
    assert sample_weights(plan.train, loss_config()) == [0.25, 0.25]  # token-mean over the 4 trained tokens
    off = plan_step([G([_sample(i, float(i % 2), "length") for i in range(4)])], 0, 1, "drop", advantage_config())
    assert len(off.train) == 4 and not off.overlong  # off by default


def test_overlong_penalty_reward_hand_computed():
    from libs.rewards.base import build
    from pipeline import codec

    score = build("overlong_penalty", {"max_tokens": 20, "cache_tokens": 5})
    halved = build("overlong_penalty", {"max_tokens": 20, "cache_tokens": 5, "penalty": 0.5})

    def traj(n):
        return {"response_tokens": codec.pack_i32([7] * n)}

    # soft zone starts at 20 - 5 = 15: 0 up to 15, then -(n - 15) / 5, -1 from 20 on
    assert [score(traj(n)).reward for n in (0, 10, 15, 16, 17, 20, 25)] == pytest.approx([0, 0, 0, -0.2, -0.4, -1, -1])
    assert halved(traj(17)).reward == pytest.approx(-0.2)
    assert score(traj(17)).details == {"response_tokens": 17.0}
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError):
        build("overlong_penalty", {"max_tokens": 20, "cache_tokens": 0})


def test_dynamic_sampling_drops_only_zero_variance_groups():
    assert not informative(G([_sample(i, 1.0) for i in range(4)]), 0, 1, "drop")
    assert not informative(G([_sample(i, 0.0) for i in range(4)]), 0, 1, "drop")
    assert informative(G([_sample(0, 1.0), *[_sample(i, 0.0) for i in range(1, 4)]]), 0, 1, "drop")
    assert informative(G([_sample(i, 1.0) for i in range(3)], complete=False), 0, 1, "drop")  # dropped anyway
    assert not informative(G([_sample(i, 1.0) for i in range(3)], complete=False), 0, 1, "train")
    # at version 3 with k = 1 the version-0 samples are stale: only the fresh ones' rewards count
    mixed = G([_sample(0, 0.0, vmin=0), _sample(1, 1.0, vmin=2), _sample(2, 1.0, vmin=3)])
    assert not informative(mixed, 3, 1, "drop") and informative(mixed, 1, 1, "drop")
    assert informative(G([_sample(0, 0.0, vmin=0), _sample(1, 1.0, vmin=0)]), 5, 1, "drop")  # all stale: kept
    assert informative(G([_sample(0, 0.5), _sample(1, 0.5 + 1e-6)]), 0, 1, "drop", tol=1e-9)
    assert not informative(G([_sample(0, 0.5), _sample(1, 0.5 + 1e-6)]), 0, 1, "drop", tol=1e-5)


def test_filtered_groups_leave_the_queue_and_late_samples_are_refused():
    asm = GroupAssembler(60.0)
    for g, rewards in (("a", [1.0, 1.0]), ("b", [1.0, 0.0]), ("c", [0.0, 0.0])):
        for i, r in enumerate(rewards):
            s = _sample(i, r, group=g)
            s.group_size = 2
            asm.add(s, 0.0)
    out = asm.filter_ready(lambda grp: informative(grp, 0, 1, "drop"))
    assert sorted(g.id for g in out) == ["a", "c"]
    assert [g.id for g in asm.take(1)] == ["b"]
    late = _sample(2, 1.0, group="a")
    assert asm.add(late, 0.0) == "late"


def test_admission_counts_from_the_consumed_groups():
    k, G_ = 1, 4
    assert control.admission_limit(3, k, G_) == (3 + k + 1) * G_ == 20  # no count: v * G consumed
    assert control.admission_limit(3, k, G_, consumed=17) == 17 + 8  # 5 groups were filtered so far
    assert control.may_admit(24, 3, k, G_, consumed=17) and not control.may_admit(25, 3, k, G_, consumed=17)
    assert control.admission_limit(3, k, G_, consumed=-1) == 20  # a v1 notice's "unknown"
