"""The names a run takes on the cluster (``pipeline.topology``) are part of its state: a resumed run
must find the same consumer groups and transactional ids. These tests pin them, byte for byte,
for the default config, a custom prefix, a named job and a chaos/bench run; and the renamed keys
of the shared ``rl`` section (old key read with a warning, both keys disagreeing refused)."""

import warnings

import pytest

from pipeline.config import settings_tree, with_settings
from pipeline.errors import ConfigError
from pipeline.topology import PIPELINE, STAGES, RunIdentity, Topology, transactional_id
from rlstream.config import load_config

DEFAULT_NAMES = {
    "topic.prompts": "rl.prompts",
    "topic.rollouts": "rl.rollouts",
    "topic.scored": "rl.scored",
    "topic.control": "rl.control",
    "topic.metrics": "rl.metrics",
    "topic.dlq": "rl.dlq",
    "topic.lease": "rl.lease",
    "topic.job": "rl.job",
    "group.rollout": "rlstream-rollout",
    "group.reward": "rlstream-reward",
    "group.trainer": "rlstream-trainer",
    "transactional_id_prefix": "rlstream-reward",
}


def test_default_names_are_pinned():
    topo = Topology(load_config(None, [], environ={}))
    assert topo.names() == DEFAULT_NAMES
    assert topo.transactional_id("reward-0") == "rlstream-reward-reward-0"
    assert topo.inputs() == [
        ("rollout", "rl.prompts", "rlstream-rollout"),
        ("reward", "rl.rollouts", "rlstream-reward"),
        ("trainer", "rl.scored", "rlstream-trainer"),
    ]


def test_a_custom_prefix_renames_topics_only():
    """``topics.prefix`` alone moves the topics; groups and transactional ids stay the defaults."""
    names = Topology(load_config(None, ["topics.prefix=exp7."], environ={})).names()
    assert names == {k: v.replace("rl.", "exp7.", 1) if k.startswith("topic.") else v for k, v in DEFAULT_NAMES.items()}


def test_job_names_are_pinned(tmp_path):
    """``rlstream run`` of a job named ``j1``: topics ``j1.*``, groups ``j1-<stage>``."""
    from rlstream.job import resolve

    job = tmp_path / "j1.toml"
    job.write_text("[job]\nrollout_workers = 1\n")
    topo = Topology(resolve(job, [f"run_dir={tmp_path}"], bootstrap="127.0.0.1:1"))
    assert topo.names() == {
        **{
            f"topic.{r}": f"j1.{r}"
            for r in ("prompts", "rollouts", "scored", "control", "metrics", "dlq", "lease", "job")
        },
        "group.rollout": "j1-rollout",
        "group.reward": "j1-reward",
        "group.trainer": "j1-trainer",
        "transactional_id_prefix": "j1-reward",
    }
    assert topo.transactional_id("reward-1") == "j1-reward-reward-1"
    # a job file that sets a name itself keeps it
    job.write_text('[job]\nrollout_workers = 1\n[reward]\ngroup_id = "mine"\n[topics]\nprefix = "p."\n')
    names = Topology(resolve(job, [f"run_dir={tmp_path}"], bootstrap="127.0.0.1:1")).names()
    assert (names["group.reward"], names["topic.scored"], names["group.trainer"]) == ("mine", "p.scored", "j1-trainer")


def test_chaos_and_bench_identity_is_pinned():
    assert RunIdentity.of_prefix("chaos-1.").settings() == {
        "topics.prefix": "chaos-1.",
        "rollout.group_id": "chaos-1.rollout",
        "reward.group_id": "chaos-1.reward",
        "trainer.group_id": "chaos-1.trainer",
        "reward.transactional_id_prefix": "chaos-1.reward",
    }
    cfg = load_config(None, [], environ={}, settings=RunIdentity.of_prefix("b.").settings())
    assert Topology(cfg).transactional_id("reward-0") == "b.reward-reward-0"
    assert transactional_id("x", "") == "x-"  # the prefix ACLs grant


def test_stage_map():
    assert PIPELINE == ("rollout", "reward", "trainer")
    assert [STAGES[s].input for s in PIPELINE] == ["prompts", "rollouts", "scored"]
    assert STAGES["reward"].outputs[0] == "scored" and STAGES["trainer"].outputs[0] == "control"
    with pytest.raises(ValueError, match="no consumer group"):
        RunIdentity.of_job("j").group("feed")


# ---- shared values: renamed keys --------------------------------------------------------------
@pytest.mark.parametrize(
    ("old", "new", "value"),
    [("trainer.staleness_rule", "rl.staleness_rule", "token"), ("feed.replicate", "rl.replicate", 3)],
)
def test_old_key_is_read_with_a_warning(tmp_path, old, new, value):
    key = new.split(".")[1]
    with pytest.warns(FutureWarning, match=f"{old} is deprecated, use {new}"):
        cfg = load_config(None, [f"{old}={value}"], environ={})
    assert getattr(cfg.rl, key) == value
    old_section, old_key = old.split(".")
    f = tmp_path / "c.toml"
    f.write_text(f"[{old_section}]\n{old_key} = {value!r}\n".replace("'", '"'))
    with pytest.warns(FutureWarning, match=new):
        assert getattr(load_config(f, [], environ={}).rl, key) == value
    env = {f"RLSTREAM_{old_section.upper()}__{old_key.upper()}": str(value)}
    with pytest.warns(FutureWarning, match=new):
        assert getattr(load_config(None, [], environ=env).rl, key) == value
    with pytest.warns(FutureWarning, match=new):
        assert getattr(load_config(None, [], environ={}, settings={old: value}).rl, key) == value
    # the same value under both keys is fine; a later layer's new key overrides an earlier old one
    with pytest.warns(FutureWarning):
        load_config(None, [f"{old}={value}", f"{new}={value}"], environ={})
    with pytest.warns(FutureWarning):
        cfg = load_config(f, [f"{new}={'sample' if key == 'staleness_rule' else 1}"], environ={})
    assert getattr(cfg.rl, key) != value


def test_old_and_new_keys_disagreeing_fail_naming_both(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.staleness_rule.*rl\.staleness_rule"):
        load_config(None, ["trainer.staleness_rule=token", "rl.staleness_rule=sample"], environ={})
    f = tmp_path / "c.toml"
    f.write_text("[feed]\nreplicate = 2\n[rl]\nreplicate = 4\n")
    with pytest.raises(ConfigError, match=r"feed\.replicate.*rl\.replicate"):
        load_config(f, [], environ={})


def test_a_whole_tree_with_an_old_key_validates(tmp_path):
    """``rlstream.Job(config={...})`` and presets give a whole tree: the root config moves the key too."""
    from rlstream.config import Config

    with pytest.warns(FutureWarning):
        cfg = Config.model_validate({"trainer": {"staleness_rule": "token"}})
    assert cfg.rl.staleness_rule == "token"


def test_new_keys_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, ["rl.staleness_rule=token", "rl.replicate=2"], environ={})
    assert (cfg.rl.staleness_rule, cfg.rl.replicate) == ("token", 2)


# ---- typed settings -----------------------------------------------------------------------------
def test_typed_settings_need_no_parsing():
    tree = settings_tree({"model.hidden_size": 64, "reward.tasks": {"t": [{"name": "exact_match"}]}})
    assert tree == {"model": {"hidden_size": 64}, "reward": {"tasks": {"t": [{"name": "exact_match"}]}}}
    base = load_config(None, [], environ={})
    cfg = with_settings(base, {"rollout.worker_id": "rollout-3", "feed.source": "a b.jsonl"})
    assert (cfg.rollout.worker_id, str(cfg.feed.source)) == ("rollout-3", "a b.jsonl")
    assert base.rollout.worker_id == ""  # the original is not changed
    with pytest.raises(ConfigError, match=r"rl\.group_size"):
        with_settings(base, {"rl.group_size": 0})


def test_a_role_with_settings_of_its_own_gets_its_own_config_file(tmp_path):
    """The launcher starts such a role with ``--config <run dir>/roles/<name>.toml``, no ``--set``."""
    from rlstream.launcher import Launcher, standard_roles

    class Sup:
        def start(self, name, args, may_exit=False, memory_limit_mb=None):
            self.started = (name, args)

    cfg = load_config(None, [f"run_dir={tmp_path}"], environ={})
    roles = {r.name: r for r in standard_roles(cfg, 1, 1, metrics_port_base=9100)}
    launcher = Launcher(cfg, tmp_path, list(roles.values()), title="t", live=False, console=None)
    shared = tmp_path / "config.toml"
    sup = Sup()
    launcher.start_role(sup, roles["reward-0"], shared)
    name, args = sup.started
    assert name == "reward-0" and args[:2] == ["reward", "--config"] and "--set" not in args
    own = load_config(args[2], [], environ={})
    assert (own.reward.worker_id, own.reward.group_instance_id, own.reward.prometheus_port) == (
        "reward-0",
        "reward-0",
        9110,
    )
    assert own.reward.group_id == cfg.reward.group_id  # everything else is the run's
    launcher.start_role(sup, roles["feed"], shared)
    assert sup.started == ("feed", ["feed", "--config", str(shared)])  # nothing of its own: the run's file
