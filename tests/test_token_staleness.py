"""``rl.staleness_rule = "token"``: which tokens a partial rollout keeps for given version marks,
k and step version (hand-computed), the step plan and dynamic sampling under it, masked tokens
contributing exactly nothing to any loss (value, gradient, GSPO's sequence ratio) even with extreme
recorded logprobs, padded and packed micro-batches agreeing, the trainer on a real broker writing
what the chaos audit needs, and the audit catching a steps log that claims too much."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.batch import TrainSample, informative, plan_step, sample_from_record, sample_weights  # noqa: E402
from consumers.trainer.collate import collate, pack  # noqa: E402
from consumers.trainer.loss_config import advantage_config, loss_config  # noqa: E402
from consumers.trainer.losses import LossFn, micro_batch_loss  # noqa: E402
from consumers.trainer.staleness import TokenCut, gate, parse_marks, token_version  # noqa: E402
from pipeline.errors import DecodeError  # noqa: E402
from pipeline.records import InvalidRecord  # noqa: E402

MARKS = ((0, 1), (4, 2), (7, 3))
"""Tokens 0-3 by version 1, 4-6 by version 2, 7-9 by version 3."""


def sample(i=0, marks=MARKS, vmin=1, vmax=3, mask=None, reward=0.0, n=10, group="g", logprobs=None):
    mask = [1] * n if mask is None else mask
    return TrainSample(
        f"{group}/{i}", group, 0, i, [5, 6], [10 + j for j in range(n)], logprobs or [-1.0 - 0.1 * j for j in range(n)],
        list(mask), reward, vmin, vmax, 4, group_seq=0, version_marks=marks,
    )  # fmt: skip


class G:
    def __init__(self, samples, complete=True):
        self.samples, self.complete = samples, complete


# ---- the rule ---------------------------------------------------------------------------------
def test_marks_are_parsed_and_checked():
    assert parse_marks("0@1,4@2,7@3", 10, 1, 3) == MARKS
    assert parse_marks("", 10, 1, 3) == () and parse_marks(None, 10, 0, 0) == ()
    assert parse_marks("3@2", 10, 1, 2) == ((3, 2),)  # tokens 0-2 before the first mark: version_min
    bad = [("0@2", 1, 2), ("0@1,4@2", 1, 3), ("0@1,0@2", 1, 2), ("0@2,4@1", 1, 2), ("0@1,12@2", 1, 2), ("x", 0, 0),
           ("0@1,4@", 1, 2)]  # fmt: skip
    for text, lo, hi in bad:
        with pytest.raises(InvalidRecord):
            parse_marks(text, 10, lo, hi)
    assert [token_version(MARKS, 1, i) for i in range(10)] == [1, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_kept_tokens_hand_computed():
    """k = 1. Version 2: every token is within k (whole sample). Version 3: version 1 is too old,
    tokens 0-3 are masked (4 trainable ones), the oldest kept is version 2. Version 4: tokens 0-6
    are masked, 6 trainable ones (token 5 is an environment token, mask 0). Version 5: nothing is
    left: stale. The sample rule drops the sample whole from version 3 on."""
    env = [1, 1, 1, 1, 1, 0, 1, 1, 1, 1]
    s = sample(mask=env)
    assert gate(s, 2, 1, "token", 0) == TokenCut(0, 0, 1)
    assert gate(s, 3, 1, "token", 0) == TokenCut(4, 4, 2)
    assert gate(s, 4, 1, "token", 0) == TokenCut(7, 6, 3)
    assert gate(s, 5, 1, "token", 0) is None
    assert gate(s, 2, 1, "sample", 0) == TokenCut(0, 0, 1) and gate(s, 3, 1, "sample", 0) is None
    assert gate(s, 4, 2, "token", 0) == TokenCut(4, 4, 2)  # k = 2 at version 4: versions 2 and 3 train
    assert gate(sample(marks=()), 3, 1, "token", 0) is None  # no marks: every token counts as version_min
    only_env = sample(mask=[1] * 7 + [0] * 3)  # the fresh tokens are all environment tokens
    assert gate(only_env, 4, 1, "token", 0) is None
    assert gate(sample(), 3, 1, "token", 5) == TokenCut(4, 0, 2)  # tokens before the trainable start don't count


def test_plan_masks_a_copy_and_keeps_the_sample_in_the_baseline():
    fresh = sample(0, marks=((0, 3),), vmin=3, vmax=3, reward=1.0)
    partial = sample(1, reward=0.0)
    old = sample(2, marks=((0, 0),), vmin=0, vmax=0, reward=1.0)
    all_old = sample(3, marks=((0, 0), (5, 1)), vmin=0, vmax=1, reward=1.0)
    plan = plan_step([G([fresh, partial, old, all_old])], 3, 1, "drop", advantage_config(), staleness_rule="token")
    assert [s.trajectory_id for s in plan.train] == ["g/0", "g/1"]
    assert [s.trajectory_id for s in plan.stale] == ["g/2", "g/3"]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # grpo over the two rewards [1, 0]
    assert [s.advantage for s in plan.train] == pytest.approx([a, -a])
    kept = plan.train[1]
    assert kept.mask.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1] and partial.mask == [1] * 10  # the record is untouched
    assert kept.cut == TokenCut(4, 4, 2) and kept is not partial and plan.train[0] is fresh
    assert plan.token_masked() == {"g/1": {"from": 4, "masked": 4, "oldest": 2}}
    assert plan.version_lag_counts() == {0: 1, 1: 1}
    by_sample = plan_step([G([fresh, partial, old, all_old])], 3, 1, "drop", advantage_config())
    assert [s.trajectory_id for s in by_sample.train] == ["g/0"] and by_sample.token_masked() == {}


def test_weights_count_only_kept_tokens():
    plan = plan_step([G([sample(0, marks=((0, 3),), vmin=3, vmax=3), sample(1)])], 3, 1, "drop", advantage_config(),
                     staleness_rule="token")  # fmt: skip
    assert sample_weights(plan.train, loss_config()) == pytest.approx([1 / 16, 1 / 16])  # 10 + 6 trained tokens
    agg = loss_config(aggregation="seq-mean-token-mean")
    assert sample_weights(plan.train, agg) == pytest.approx([1 / 20, 1 / 12])


def test_dynamic_sampling_judges_by_the_rule():
    group = G([sample(0, marks=((0, 3),), vmin=3, vmax=3, reward=1.0), sample(1, reward=0.0)])
    assert not informative(group, 3, 1, "drop")  # sample rule: the partial one is stale, one reward left
    assert informative(group, 3, 1, "drop", staleness_rule="token")  # token rule: it trains, rewards differ


def test_records_carry_their_marks_only_under_the_token_rule():
    from pipeline import codec
    from tests.test_trainer import scored

    rec = scored("g", 0, 2, 0, 1.0)
    rec["trajectory"]["response_tokens"] = codec.pack_i32([10] * 6)
    rec["trajectory"]["logprobs"] = codec.pack_f32([-1.0] * 6)
    rec["trajectory"]["loss_mask"] = b""
    rec["trajectory"].update(version_min=0, version_max=2, metadata={"versions": "0@0,2@1,5@2"})
    assert sample_from_record(rec, 0, 0, token_versions=True).version_marks == ((0, 0), (2, 1), (5, 2))
    assert sample_from_record(rec, 0, 0).version_marks == ()  # the sample rule does not read them
    rec["trajectory"]["metadata"] = {"versions": "0@0,2@1"}  # says version 1 is the newest: it is 2
    with pytest.raises(DecodeError, match="disagree"):
        sample_from_record(rec, 0, 0, token_versions=True)
    assert sample_from_record(rec, 0, 0).version_max == 2


# ---- the loss ---------------------------------------------------------------------------------
LOSSES = [
    loss_config(type="ppo_clip"),
    loss_config(type="tis"),
    loss_config(type="decoupled_ppo"),
    loss_config(type="cispo"),
    loss_config(type="gspo", aggregation="seq-mean-token-mean"),
    loss_config(type="ppo_clip", kl_coef=0.1, entropy_coef=0.01),
]


def _masked_batch(stale_logprob: float, build=collate):
    """A fresh sample and a partial rollout whose tokens 0-3 are masked at version 3 (k = 1); the
    masked tokens' recorded logprobs are ``stale_logprob``."""
    lps = [stale_logprob] * 4 + [-1.0 - 0.1 * j for j in range(4, 10)]
    samples = [sample(0, marks=((0, 3),), vmin=3, vmax=3, reward=1.0), sample(1, logprobs=lps, reward=0.0)]
    plan = plan_step([G(samples)], 3, 1, "drop", advantage_config(), staleness_rule="token")
    return plan.train, build(plan.train, sample_weights(plan.train, loss_config()))


@pytest.mark.parametrize("cfg", LOSSES, ids=lambda c: f"{c.type}-kl{c.kl_coef}")
def test_masked_tokens_contribute_nothing(cfg):
    """Zero gradient at every masked position, finite values although exp(logp - mu) of a masked
    token would overflow (mu = -300), and the same loss and gradients whatever the masked tokens'
    recorded logprobs are."""
    out = []
    for stale_lp in (-300.0, -0.5):
        _, mb = _masked_batch(stale_lp)
        gen = torch.Generator().manual_seed(0)
        logp = (-torch.rand(mb.token_mask.shape, generator=gen) * 2).requires_grad_(True)
        mb.prox_logp = (logp.detach() - 0.05).clone()
        mb.ref_logp = (logp.detach() + 0.1).clone()
        entropy = torch.rand(mb.token_mask.shape, generator=gen).requires_grad_(True)
        loss, stats = micro_batch_loss(logp, mb, cfg, entropy)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert (logp.grad[mb.token_mask == 0] == 0).all()
        if cfg.entropy_coef > 0:
            assert (entropy.grad[mb.token_mask == 0] == 0).all() and (entropy.grad[mb.token_mask == 1] != 0).all()
        assert (logp.grad[mb.token_mask == 1] != 0).any()
        out.append((float(loss.detach()), logp.grad.clone(), stats))
    assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1])
    assert out[0][2] == out[1][2]


def test_kept_tokens_use_their_own_behaviour_logprobs_and_gspo_ratio_is_over_them():
    samples, mb = _masked_batch(-300.0)
    logp = torch.full(mb.token_mask.shape, -1.0)
    _, st = micro_batch_loss(logp, mb, loss_config(type="ppo_clip"))
    # row 1: prompt of 2 tokens, so response token j is predicted at position 1 + j; kept j = 4..9
    ratios = [math.exp(-1.0 - samples[1].logprobs[j]) for j in range(4, 10)]
    assert st["ratio"][0] == pytest.approx(sum(math.exp(-1.0 - lp) for lp in samples[0].logprobs) + sum(ratios))
    assert st["ratio"][1] == 16.0
    from consumers.trainer.losses import gspo

    old = torch.where(mb.token_mask > 0, mb.old_logp, logp)
    _, g = gspo(logp, old, mb.per_token(mb.advantages), mb.token_mask, 3e-4, 4e-4)
    want = math.exp(sum(-1.0 - samples[1].logprobs[j] for j in range(4, 10)) / 6)  # mean over the kept 6
    assert float(g["ratio"][1, 5]) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
def test_packed_masked_samples_equal_padded_ones(loss):
    """On the tiny model: the same masked samples packed or padded give the same loss and gradients."""
    from consumers.trainer.engines.base import forward_loss
    from tests.test_packing import setup

    cfg, eng = setup(f"trainer.loss.type={loss}", "trainer.loss.aggregation=seq-mean-token-mean")
    results = []
    for build in (collate, pack):
        _, mb = _masked_batch(-300.0, build)
        eng.module.zero_grad(set_to_none=True)
        value, _ = forward_loss(eng.module, mb, LossFn(cfg.trainer.loss))
        value.backward()
        results.append((float(value.detach()), {n: p.grad.clone() for n, p in eng.module.named_parameters()}))
    (padded, g_pad), (packed, g_pack) = results
    assert math.isfinite(padded) and padded != 0.0 and packed == pytest.approx(padded, rel=1e-5, abs=1e-7)
    for n in g_pad:
        torch.testing.assert_close(g_pack[n], g_pad[n], rtol=1e-4, atol=1e-6)


# ---- the audit --------------------------------------------------------------------------------
def _audit(rows, steps, k=1):
    from rlstream.dev.chaos_audit import audit

    data = {"prompts": [], "rollouts": [], "dlq": [], "scored": rows}
    topics = {"prompts": "p", "rollouts": "r", "scored": "s"}
    return audit(data, steps, [], topics=topics, feed="f", expected_groups=0, k=k)


def test_the_audit_checks_the_oldest_trained_token_against_the_record():
    rows = [{"p": 0, "o": 0, "tid": "g/0", "gid": "g", "version_min": 1, "versions": "0@1,4@2,7@3", "src": (0, 0)},
            {"p": 0, "o": 1, "tid": "g/1", "gid": "g", "version_min": 3, "versions": "0@3", "src": (0, 1)}]  # fmt: skip
    step = {"step": 4, "version": 3, "used": ["g/0", "g/1"], "stale": [], "incomplete_dropped": [], "groups": ["g"],
            "loss": 0.0,
            "token_masked": {"g/0": {"from": 4, "masked": 4, "oldest": 2}}}  # fmt: skip
    assert _audit(rows, [step])["staleness_violations"] == 0
    for claim in ({"from": 0, "masked": 0, "oldest": 2}, {"from": 4, "masked": 4, "oldest": 3}):
        bad = {**step, "token_masked": {"g/0": claim}}  # trained from a version-1 token / a wrong claim
        assert _audit(rows, [bad])["staleness_violations"] == 1
    assert _audit(rows, [{**step, "token_masked": {}}])["staleness_violations"] == 1  # the sample rule's check


# ---- the trainer on a real broker -------------------------------------------------------------
def _record(gid, i, vmin, vmax, marks, n=6, seq=0):
    from pipeline import codec
    from tests.test_trainer import scored

    rec = scored(gid, i, 2, vmin, float(i), seq=seq)
    t = rec["trajectory"]
    t["response_tokens"] = codec.pack_i32([20 + j for j in range(n)])
    t["logprobs"] = codec.pack_f32([-3.0] * n)
    t["loss_mask"] = b""
    t.update(version_max=vmax, metadata={"versions": marks} if marks else {})
    return rec


@pytest.mark.kafka
def test_trainer_masks_old_tokens_and_the_audit_agrees(make_config):
    """k = 1, one group per step. Step 3 (version 2) gets a partial rollout of versions 0/1/2
    (tokens 0-2, 3-4, 5): tokens 0-2 are masked, it trains from token 3 (version 1); its sibling,
    all version 0, is stale. The steps log says so and the chaos audit, reading the records, finds
    no violation."""
    from consumers.trainer.state import read_steps_log
    from consumers.trainer.worker import Trainer
    from rlstream.dev.chaos_audit import audit, read_topics
    from tests.test_trainer import TINY, ScoredProducer

    cfg = make_config(*TINY, "rl.group_size=2", "rl.groups_per_step=1", "rl.max_staleness=1",
                      "topics.scored.partitions=1", "rl.staleness_rule=token", "trainer.poll_timeout_s=0.2")  # fmt: skip
    sp = ScoredProducer(cfg)
    sp.send([_record("g0", i, 0, 0, "0@0", seq=0) for i in range(2)])
    sp.send([_record("g1", i, 1, 1, "0@1", seq=1) for i in range(2)])
    sp.send([_record("g2", 0, 0, 2, "0@0,3@1,5@2", seq=2), _record("g2", 1, 0, 0, "0@0", seq=2)])
    sp.close()
    assert Trainer(cfg, max_steps=3).run() == 3
    steps = read_steps_log(Path(cfg.run_dir) / "trainer")
    assert steps[2]["used"] == ["g2/0"] and steps[2]["stale"] == ["g2/1"]
    assert steps[2]["token_masked"] == {"g2/0": {"from": 3, "masked": 3, "oldest": 1}}
    assert steps[2]["staleness"] == {"1": 1} and all(s["token_masked"] == {} for s in steps[:2])
    data = read_topics(cfg, timeout=60)
    topics = {r: cfg.topics.name(r) for r in ("prompts", "rollouts", "scored")}
    res = audit(data, steps, [], topics=topics, feed="f", expected_groups=0, k=1)
    assert res["staleness_violations"] == 0 and res["trained_twice"] == 0
    steps[2]["token_masked"]["g2/0"]["from"] = 2  # a log claiming it trained a version-0 token
    assert audit(data, steps, [], topics=topics, feed="f", expected_groups=0, k=1)["staleness_violations"] == 1
