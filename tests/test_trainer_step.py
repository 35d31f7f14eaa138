"""One trainer step without a broker: minibatches cover every sample once; decoupled PPO's proximal
logprobs come from the weights before the step's first update; the KL reference is the version-0
model; every loss runs end to end; a step without samples does not touch the weights."""

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.engines import TrainContext, build_engine  # noqa: E402
from consumers.trainer.losses import LossFn  # noqa: E402
from consumers.trainer.step import train_samples  # noqa: E402
from pipeline.models import load_model, materialize  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from tests.test_deepspeed import TINY, assert_close, make_samples  # noqa: E402


def setup(*extra):
    cfg = load_config(None, [*TINY, "trainer.lr=0.05", "trainer.micro_batch_size=2", *extra], environ={})
    d = materialize(cfg.model)
    return cfg, d, build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))


def run(cfg, eng, samples, **kw):
    return train_samples(eng, samples, cfg.trainer, LossFn(cfg.trainer.loss), 1, **kw)


def test_decoupled_ppo_proximal_is_the_weights_before_the_first_update():
    cfg, d, eng = setup("trainer.loss.type=decoupled_ppo", "trainer.minibatches=2")
    initial = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))  # frozen copy of the starting weights
    seen = []

    def inspect(mbs):
        seen.append([(mb, eng.compute_logprobs([mb])[0]) for mb in mbs])

    out = run(cfg, eng, make_samples(7), on_minibatch=inspect)
    assert out["optimizer_steps"] == 2 and len(seen) == 2
    ids = [i for mbs in seen for mb, _ in mbs for i in mb.ids]
    assert sorted(ids) == sorted(s.trajectory_id for s in make_samples(7))  # each sample in one update
    for mb, current in seen[1]:  # second minibatch: the weights moved, the proximal policy did not
        start = initial.compute_logprobs([mb])[0]
        torch.testing.assert_close(mb.prox_logp, start)
        assert float(((current - start).abs() * mb.token_mask).max()) > 1e-5


def test_kl_reference_is_the_initial_model():
    cfg, d, eng = setup("trainer.loss.kl_coef=0.5", "trainer.minibatches=2")
    ref = load_model(d).eval().requires_grad_(False)
    initial = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    refs = []
    out = run(cfg, eng, make_samples(7), ref=ref, on_minibatch=lambda mbs: refs.extend(mbs))
    for mb in refs:
        torch.testing.assert_close(mb.ref_logp, initial.compute_logprobs([mb])[0])
    assert out["stats"]["kl"] > 0  # the second update is away from the reference


@pytest.mark.parametrize("loss", ["ppo_clip", "tis", "decoupled_ppo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_every_loss_trains(loss, agg):
    cfg, _, eng = setup(f"trainer.loss.type={loss}", f"trainer.loss.aggregation={agg}")
    before = eng.state_dict()
    out = run(cfg, eng, make_samples(5))
    assert out["optimizer_steps"] == 1 and out["grad_norm"] > 0 and out["loss"] != 0
    with pytest.raises(AssertionError):
        assert_close(before, eng.state_dict())


def test_a_step_without_samples_leaves_the_weights_alone():
    cfg, _, eng = setup()
    run(cfg, eng, make_samples(5))  # Adam now has momentum that a zero-gradient update would apply
    before = eng.state_dict()
    out = run(cfg, eng, [])
    assert out["optimizer_steps"] == 0
    assert_close(before, eng.state_dict(), atol=0, rtol=0)
