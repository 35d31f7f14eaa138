"""Config loading: precedence, strictness, errors that name the key, TOML round trip."""

import pytest

from pipeline.config import dump_toml
from pipeline.errors import ConfigError
from rlstream.config import load_config


def test_defaults_are_valid():
    cfg = load_config(environ={})
    assert cfg.topics.name("rollouts") == "rl.rollouts"
    assert cfg.topics.control.partitions == 1
    assert cfg.rl.max_staleness >= 1


def test_precedence_file_env_cli(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[rl]\nmax_staleness = 2\ngroup_size = 4\n[topics]\nprefix = 'file.'\n")
    env = {"RLSTREAM_RL__MAX_STALENESS": "3", "RLSTREAM_TOPICS__PREFIX": "env."}
    cfg = load_config(f, ["topics.prefix=cli."], environ=env)
    assert cfg.rl.group_size == 4  # file
    assert cfg.rl.max_staleness == 3  # env beats file
    assert cfg.topics.prefix == "cli."  # --set beats env


@pytest.mark.parametrize(
    "override, key",
    [
        ("rl.max_stalenes=1", "rl.max_stalenes: unknown key"),
        ("rl.max_staleness=-1", "rl.max_staleness"),
        ("topics.control.partitions=3", "topics.control.partitions must be 1"),
        ("broker.port=70000", "broker.port"),
        ("topics.rollouts.max_message_bytes=99999999", "topics.rollouts.max_message_bytes"),
        ("kafka=3", "kafka"),
        ('kafka.consumer={"group.protocol"="kip848"}', "kafka.consumer: Value error, group.protocol = 'kip848'"),
        ("rollout.overprovision=-1", "rollout.overprovision"),
    ],
)
def test_errors_name_the_bad_key(override, key):
    with pytest.raises(ConfigError) as ei:
        load_config(overrides=[override], environ={})
    assert key in str(ei.value)


def test_over_provisioned_groups_need_the_whole_group_in_one_message():
    with pytest.raises(ConfigError) as ei:
        load_config(overrides=["rollout.overprovision=2", "rl.replicate=2"], environ={})
    assert "\n  rollout.overprovision=2 needs every group in one prompt message" in str(ei.value)  # no "<root>"
    assert load_config(overrides=["rollout.overprovision=2"], environ={}).rollout.overprovision == 2


def test_a_trained_tail_needs_over_provisioned_groups():
    with pytest.raises(ConfigError, match=r"overprovision_tail='train' .* rollout.overprovision=0 draws none"):
        load_config(overrides=["rollout.overprovision_tail=train"], environ={})
    cfg = load_config(overrides=["rollout.overprovision=1", "rollout.overprovision_tail=train"], environ={})
    assert cfg.rollout.overprovision_tail == "train"


def test_the_trainer_says_how_large_a_step_with_the_tail_is():
    from consumers.trainer.worker import tail_step_note

    assert tail_step_note(load_config(overrides=["rollout.overprovision=2"], environ={})) is None
    sets = ["rl.group_size=8", "rl.groups_per_step=4", "rollout.overprovision=2", "rollout.overprovision_tail=train"]
    note = tail_step_note(load_config(overrides=sets, environ={}))
    assert (
        "up to 40 samples (4 groups of 8 + 2)" in note
        and "rl.groups_per_step=3 keeps about the default rule's 32" in note
        and "rl.group_size=6 keeps its 8 draws a prompt and 32 a step" in note
    )
    sets[:2] = ["rl.group_size=3", "rl.groups_per_step=2"]  # a quorum of 1 is not offered
    assert "rl.group_size" not in tail_step_note(load_config(overrides=sets, environ={}))


def test_both_group_protocols_are_accepted():
    for proto in ("classic", "consumer", "CONSUMER"):
        cfg = load_config(overrides=[f'kafka.consumer={{"group.protocol"="{proto}"}}'], environ={})
        assert cfg.kafka.consumer["group.protocol"] == proto


def test_bad_env_key_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="nosuch: unknown key"):
        load_config(environ={"RLSTREAM_NOSUCH": "1"})
    f = tmp_path / "bad.toml"
    f.write_text("[rl\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", environ={})
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["rl.max_staleness"], environ={})


def test_dump_toml_round_trips(tmp_path):
    cfg = load_config(overrides=["rl.max_staleness=4", 'kafka.producer={"linger.ms" = 7}'], environ={})
    f = tmp_path / "resolved.toml"
    f.write_text(dump_toml(cfg))
    again = load_config(f, environ={})
    assert again == cfg


def test_a_none_whose_default_is_not_none_survives_the_config_file(tmp_path):
    """TOML has no null: a None left out of the file read back as the default (the launcher hands
    every role the job's config as a file, so a job built in code with an uncapped decoupled PPO
    trained with the cap of 5). It is written, and may be set, as "none"."""
    from pipeline.config import with_settings

    cfg = load_config(None, ['trainer.loss={type="decoupled_ppo"}'], environ={})
    assert cfg.trainer.loss.behav_weight_cap == 5.0
    uncapped = with_settings(cfg, {"trainer.loss.behav_weight_cap": None})
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(uncapped))
    assert load_config(str(path), [], environ={}).trainer.loss.behav_weight_cap is None
    assert (
        load_config(str(path), ["trainer.loss.behav_weight_cap=2.5"], environ={}).trainer.loss.behav_weight_cap == 2.5
    )
    cli = load_config(None, ['trainer.loss={type="decoupled_ppo"}', "trainer.loss.behav_weight_cap=none"], environ={})
    assert cli.trainer.loss.behav_weight_cap is None
    with pytest.raises(ConfigError, match=r'behav_weight_cap.*"none" for none'):  # any other word: an error
        load_config(None, ['trainer.loss={type="decoupled_ppo"}', "trainer.loss.behav_weight_cap=off"], environ={})
    servers = load_config(None, ["kafka.bootstrap_servers=none"], environ={}).kafka.bootstrap_servers
    assert servers == "none"  # a setting that takes a string keeps the word


def test_partial_union_table_keeps_default_type():
    cfg = load_config(overrides=["model.hidden_size=64", "rollout.engine.device=cpu"], environ={})
    assert cfg.model.type == "tiny" and cfg.model.hidden_size == 64
    assert cfg.rollout.engine.type == "hf" and cfg.rollout.engine.device == "cpu"
    cfg = load_config(overrides=['model.type="pretrained"', 'model.path="/m"'], environ={})
    assert cfg.model.type == "pretrained"
    with pytest.raises(ConfigError, match=r"model\.pretrained\.hidden_size"):
        load_config(overrides=['model.type="pretrained"', 'model.path="/m"', "model.hidden_size=3"], environ={})


def test_resolved_config_files_never_hold_secrets(tmp_path):
    from pipeline.config import write_resolved

    cfg = load_config(
        None,
        ['kafka.common={"sasl.password" = "pw-123", "sasl.username" = "u"}', 'broker.users={admin = "adminpw-1"}',
         'rollout.engine={type = "openai", api_key = "sk-1"}', "rollout.max_new_tokens=7"],
        environ={},
    )  # fmt: skip
    text = write_resolved(cfg, tmp_path, "x").read_text()
    assert "pw-123" not in text and "adminpw-1" not in text and "sk-1" not in text
    assert '"sasl.username" = "u"' in text and "max_new_tokens = 7" in text  # only the secrets go


def test_consumers_re_check_a_full_fetch_queue_every_20_ms_unless_configured():
    """librdkafka's default (1 s) stalled a consumer reading a backlog for ~0.9 s each time its
    64 MB queue filled (pipeline.kafka.consumer.FETCH_QUEUE_BACKOFF_MS); kafka.consumer wins."""
    from pipeline.kafka import Consumer, client_conf

    default = Consumer(client_conf(load_config(None, [], environ={}), "t", kind="consumer"))
    tuned = load_config(None, ['kafka.consumer={"fetch.queue.backoff.ms" = 5}'], environ={})
    assert default._conf["fetch.queue.backoff.ms"] == 20
    assert Consumer(client_conf(tuned, "t", kind="consumer"))._conf["fetch.queue.backoff.ms"] == 5


def test_broker_java_options_are_checked():
    from rlstream.config import BROKER_JVM_OPTIONS, BrokerConfig

    assert BrokerConfig().jvm_options == list(BROKER_JVM_OPTIONS)
    assert BrokerConfig(jvm_options=[]).jvm_options == []
    with pytest.raises(ValueError, match=r"set broker\.heap_mb instead"):
        BrokerConfig(jvm_options=["-Xmx4g"])
    with pytest.raises(ValueError, match="is not a java option"):
        BrokerConfig(jvm_options=["TieredStopAtLevel=1"])
