"""The loss and advantage plug-in seams: the registries (built-ins by name, a user loss or
estimator by its dotted path, unknown names listing the choices), the per-loss config union
(each loss's own keys, errors naming the key), the deprecated flat keys (mapped with a warning
naming the new key, or an error naming both), and the train engine's declared capabilities."""

import warnings

import pytest

from consumers.trainer import advantages
from consumers.trainer.advantages import ADVANTAGES, build_advantage
from consumers.trainer.loss_config import CISPOLossConfig, advantage_config, loss_config
from pipeline.config import dump_toml
from pipeline.errors import ConfigError
from rlstream.config import load_config

HERE = "tests.user_plugins"  # the user plug-ins, named by their dotted path


def cfg_of(*overrides):
    return load_config(None, list(overrides), environ={})


# ---- advantages --------------------------------------------------------------------------------


def test_advantage_registry_builtins_and_user_estimators():
    assert ADVANTAGES.get("rloo") is advantages.RLOO
    assert isinstance(build_advantage(advantage_config(estimator="dr_grpo")), advantages.DrGRPO)
    pytest.importorskip("torch")  # the user module also holds a loss
    cfg = cfg_of(f'trainer.advantage.estimator="{HERE}:Centered"', "trainer.advantage.options={shift = 1.0}")
    assert advantages.compute([1.0, 3.0], cfg.trainer.advantage) == [0.0, 2.0]
    assert advantages.compute([0.5, -2.0], advantage_config(estimator=f"{HERE}:signs")) == [1.0, -1.0]


def test_unknown_advantage_names_the_choices():
    with pytest.raises(
        ConfigError, match=r"trainer\.advantage.*unknown advantage estimator 'ppo'.*grpo, dr_grpo, rloo"
    ):
        cfg_of("trainer.advantage.estimator=ppo")
    with pytest.raises(ConfigError, match="unknown advantage estimator 'nope'; built-ins: dr_grpo, grpo, rloo"):
        ADVANTAGES.get("nope")
    with pytest.raises(ConfigError, match="cannot import"):
        build_advantage(advantage_config(estimator="no_such_pkg.mod:Thing"))


def test_grpo_keys_under_another_estimator_are_ignored_with_a_warning():
    with pytest.warns(FutureWarning, match=r'trainer\.advantage\.eps has no effect with estimator = "rloo"'):
        cfg = cfg_of("trainer.advantage.estimator=rloo", "trainer.advantage.eps=0.001")
    assert cfg.trainer.advantage.estimator == "rloo" and not hasattr(cfg.trainer.advantage, "eps")
    assert cfg_of("trainer.advantage.eps=0.001").trainer.advantage.eps == 0.001  # grpo: the default
    with pytest.raises(ConfigError, match=r"trainer\.advantage\.grpo\.eps"):
        cfg_of("trainer.advantage.eps=0")


# ---- losses: config ----------------------------------------------------------------------------


def test_each_loss_has_its_own_keys_and_defaults():
    cfg = cfg_of("trainer.loss.type=cispo", "trainer.loss.eps_high=2.0", "trainer.loss.kl_coef=0.1")
    loss = cfg.trainer.loss
    assert isinstance(loss, CISPOLossConfig) and (loss.eps_low, loss.eps_high, loss.kl_coef) == (1.0, 2.0, 0.1)
    assert cfg_of("trainer.loss.type=gspo").trainer.loss.eps_high == 4e-4
    assert cfg_of("trainer.loss.type=tis").trainer.loss.cap == 2.0
    assert cfg_of("trainer.loss.aggregation=seq-mean-token-sum").trainer.loss.type == "ppo_clip"  # partial table


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.loss.type=tis", "trainer.loss.eps_low=0.1"], "trainer.loss.tis.eps_low: unknown key"),
        (["trainer.loss.type=tis", "trainer.loss.cap=0"], "trainer.loss.tis.cap"),
        (["trainer.loss.type=cispo", "trainer.loss.eps_low=2"], "trainer.loss.cispo.eps_low"),
        (["trainer.loss.aggregation=mean"], "trainer.loss.ppo_clip.aggregation"),
        ([f'trainer.loss.type="{HERE}:Scaled"', "trainer.loss.scale=2"], "trainer.loss.plugin.scale: unknown key"),
    ],
)
def test_per_loss_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as ei:
        cfg_of(*overrides)
    assert key in str(ei.value)


def test_unknown_loss_names_the_choices():
    with pytest.raises(ConfigError, match=r"unknown loss 'ppo'; built-ins: ppo_clip, tis, decoupled_ppo, cispo, gspo"):
        cfg_of("trainer.loss.type=ppo")


@pytest.mark.parametrize(
    "type_, old, new, value",
    [
        ("ppo_clip", "clip_eps_high", "eps_high", 0.28),
        ("decoupled_ppo", "clip_eps_low", "eps_low", 0.1),
        ("tis", "tis_cap", "cap", 3.0),
        ("cispo", "cispo_eps_high", "eps_high", 2.0),
        ("gspo", "gspo_eps_low", "eps_low", 0.01),
    ],
)
def test_deprecated_flat_keys_map_onto_the_new_key_with_a_warning(type_, old, new, value):
    with pytest.warns(FutureWarning, match=rf"trainer\.loss\.{old} is deprecated: use trainer\.loss\.{new}"):
        cfg = cfg_of(f"trainer.loss.type={type_}", f"trainer.loss.{old}={value}")
    assert getattr(cfg.trainer.loss, new) == value


def test_deprecated_keys_of_another_loss_and_conflicts():
    with pytest.warns(
        FutureWarning, match=r'trainer\.loss\.tis_cap has no effect with type = "ppo_clip".*trainer\.loss\.cap'
    ):
        assert cfg_of("trainer.loss.tis_cap=3").trainer.loss.type == "ppo_clip"
    with pytest.warns(FutureWarning, match="behav_weight_cap has no effect"):
        cfg_of("trainer.loss.type=cispo", "trainer.loss.behav_weight_cap=2")
    assert (
        cfg_of("trainer.loss.type=decoupled_ppo", "trainer.loss.behav_weight_cap=2").trainer.loss.behav_weight_cap == 2
    )
    with pytest.raises(ConfigError, match=r"cispo_eps_low \(deprecated\) = 0.5 and trainer\.loss\.eps_low = 0.2"):
        cfg_of("trainer.loss.type=cispo", "trainer.loss.cispo_eps_low=0.5", "trainer.loss.eps_low=0.2")


def test_old_example_with_flat_keys_still_loads(tmp_path):
    f = tmp_path / "old.toml"
    f.write_text(
        '[trainer]\nloss = { type = "decoupled_ppo", clip_eps_low = 0.2, clip_eps_high = 0.28, '
        'behav_weight_cap = 4.0, aggregation = "token-mean" }\n'
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = load_config(f, environ={}).trainer.loss
    assert sorted(str(w.message) for w in caught) == [
        'trainer.loss.clip_eps_high is deprecated: use trainer.loss.eps_high (with type = "decoupled_ppo")',
        'trainer.loss.clip_eps_low is deprecated: use trainer.loss.eps_low (with type = "decoupled_ppo")',
    ]
    assert (loss.type, loss.eps_low, loss.eps_high, loss.behav_weight_cap) == ("decoupled_ppo", 0.2, 0.28, 4.0)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.loss.type=cispo", "trainer.loss.eps_high=2.5", "trainer.advantage.estimator=rloo"],
        [f'trainer.loss.type="{HERE}:Scaled"', "trainer.loss.options={scale = 2.0}", "trainer.loss.kl_coef=0.1"],
    ],
)
def test_resolved_config_round_trips(tmp_path, overrides):
    cfg = cfg_of(*overrides)
    f = tmp_path / "resolved.toml"
    f.write_text(dump_toml(cfg))
    assert load_config(f, environ={}) == cfg


# ---- losses: registry and LossFn (torch) ------------------------------------------------------


def _micro_batch():
    torch = pytest.importorskip("torch")
    from consumers.trainer.batch import TrainSample, collate

    s = TrainSample("g/0", "g", 0, 0, [5, 6], [7, 8, 9], [-1.0, -1.0, -1.0], [1, 1, 1], 1.0, 0, 0, 2, advantage=2.0)
    mb = collate([s], [1.0 / 3], 0)
    return torch, mb, torch.full(mb.targets.shape, -0.5, dtype=torch.float32)


def test_loss_registry_builtins_and_unknown_names():
    pytest.importorskip("torch")
    from consumers.trainer import losses

    assert losses.LOSSES.get("gspo") is losses.GSPO
    assert isinstance(losses.build_loss(loss_config(type="cispo")), losses.CISPO)
    assert losses.LossFn(loss_config(type="decoupled_ppo")).needs_prox_logp
    assert not losses.LossFn(loss_config()).needs_prox_logp
    with pytest.raises(
        ConfigError, match="unknown loss 'nope'; built-ins: cispo, decoupled_ppo, gspo, ppo_clip, sft, tis"
    ):
        losses.LOSSES.get("nope")
    with pytest.raises(ConfigError, match="has no attribute Missing"):
        losses.build_loss(loss_config(type=f"{HERE}:Missing"))
    with pytest.raises(ConfigError, match="neither a subclass"):
        losses.build_loss(loss_config(type=f"{HERE}:NOT_A_PLUGIN"))


def test_user_loss_class_and_function_by_dotted_path():
    torch, mb, logp = _micro_batch()
    from consumers.trainer.losses import LossFn

    cfg = cfg_of(f'trainer.loss.type="{HERE}:Scaled"', "trainer.loss.options={scale = 3.0}")
    fn = LossFn(cfg.trainer.loss)
    assert fn.needs_prox_logp and not fn.needs_entropy  # declared by the user's class
    loss, stats = fn(logp, mb)
    trained = float(mb.token_mask.sum())
    assert float(loss) == pytest.approx(-3.0 * 2.0 * -0.5 * trained / 3)  # token-mean weights 1/3
    assert stats["scale"] == (trained, trained)
    loss_f, _ = LossFn(loss_config(type=f"{HERE}:scaled_pg"))(logp, mb)
    assert float(loss_f) == pytest.approx(float(loss) / 3.0)
    assert torch.isfinite(loss_f)


# ---- train engine capabilities ----------------------------------------------------------------


def test_single_process_engine_refuses_several_ranks(monkeypatch):
    pytest.importorskip("torch")
    from consumers.trainer.engines import TRAIN_ENGINES, TrainContext, TrainEngine, build_engine

    assert TRAIN_ENGINES.get("sim").multi_process is False and TRAIN_ENGINES.get("torch").multi_process
    assert TrainEngine.autocast is None
    cfg = cfg_of('trainer.engine={type = "sim", token_cost_s = 0.0}')
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="'sim' runs in one process; it was launched with 2 ranks"):
        build_engine(cfg.trainer.engine, TrainContext(None, cfg.trainer))


def test_user_train_engine_by_dotted_path():
    cfg = cfg_of('trainer.engine={type = "my_pkg.train:MyEngine", options = {lr_scale = 2}}')
    assert cfg.trainer.engine.type == "my_pkg.train:MyEngine" and cfg.trainer.engine.options == {"lr_scale": 2}
    with pytest.raises(ConfigError, match="unknown type 'jax'"):
        cfg_of("trainer.engine.type=jax")
