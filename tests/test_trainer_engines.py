"""Engines without a broker: the config union picks the engine; the torch engine's checkpoint
restores model, optimizer and schedule exactly; the sim engine trains nothing and counts tokens."""

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.batch import sample_weights, shard_micro_batches  # noqa: E402
from consumers.trainer.engines import TrainContext, build_engine  # noqa: E402
from consumers.trainer.losses import LossFn  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.models import materialize  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from tests.test_deepspeed import TINY, assert_close, make_samples  # noqa: E402


def cfg_of(*extra):
    return load_config(None, [*TINY, "trainer.lr=0.01", "trainer.optim.warmup_steps=3", *extra], environ={})


def step(engine, cfg):
    samples = make_samples()
    mbs = shard_micro_batches(samples, sample_weights(samples, cfg.trainer.loss), 0, 1, 2)
    return engine.train_step(mbs, LossFn(cfg.trainer.loss))


def test_engine_union_is_strict():
    assert cfg_of("trainer.engine.type=deepspeed").trainer.engine.zero_stage == 2
    assert cfg_of('trainer.engine={type = "sim", token_cost_s = 0.0}').trainer.engine.token_cost_s == 0.0
    with pytest.raises(ConfigError, match="zero_stage"):
        cfg_of("trainer.engine.zero_stage=2")  # a deepspeed key on the default torch engine
    with pytest.raises(ConfigError, match="zero_stage"):
        cfg_of("trainer.engine.type=deepspeed", "trainer.engine.zero_stage=4")
    with pytest.raises(ConfigError, match="type"):
        cfg_of("trainer.engine.type=jax")


def test_torch_engine_checkpoint_restores_optimizer_and_schedule(tmp_path):
    cfg = cfg_of()
    d = materialize(cfg.model)
    a = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    step(a, cfg)
    a.save(tmp_path / "ck")
    lr_saved = a.lr
    step(a, cfg)
    b = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    b.load(tmp_path / "ck")
    assert b.lr == lr_saved and lr_saved < cfg.trainer.lr  # still warming up: the schedule came back
    step(b, cfg)
    assert_close(a.state_dict(), b.state_dict(), atol=0, rtol=0)
    c = build_engine(
        cfg.trainer.engine, TrainContext(d, cfg.trainer)
    )  # without the optimizer state the same step lands elsewhere
    c.module.load_state_dict(torch.load(tmp_path / "ck" / "engine.pt", weights_only=True)["model"])
    step(c, cfg)
    with pytest.raises(AssertionError):
        assert_close(a.state_dict(), c.state_dict())


def test_sim_engine_trains_nothing_and_counts_tokens(tmp_path):
    cfg = cfg_of('trainer.engine={type = "sim", token_cost_s = 0.0}')
    eng = build_engine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
    before = eng.state_dict()
    res = step(eng, cfg)
    assert res.loss == 0.0 and eng.steps == 1
    assert eng.tokens == sum(len(s.prompt) + len(s.response) for s in make_samples())
    assert_close(before, eng.state_dict(), atol=0, rtol=0)
    eng.save(tmp_path / "s")
    other = build_engine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
    other.load(tmp_path / "s")
    assert (other.steps, other.tokens) == (eng.steps, eng.tokens)
