"""Kafka security: SASL/SCRAM + TLS through ``kafka.common``, the local broker's
``sasl_ssl`` mode with ACLs, and the pipeline run with one principal per role under least-privilege
ACLs (``rlstream.kafka_tools.role_acls``), each role refused where it has no right.

The Kafka tests start a secured broker of their own (whatever broker the session uses), so they need
Java, keytool and Maven as the local broker does."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, ConsumeError, DeliveryError, KafkaClientError, TopicError
from rlstream.config import load_config
from rlstream.kafka_tools import java_client_properties, role_acls

USERS = {
    "admin": "admin-Secret-0",
    "feed": "feed-Secret-1",
    "rollout": "rollout-Secret-2",
    "reward": "reward-Secret-3",
    "trainer": "trainer-Secret-4",
}
TINY = ["model.hidden_size=32", "model.num_heads=2", "model.num_layers=1", "model.intermediate_size=64"]
local_broker_tools = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("java", "keytool", "mvn")),
    reason="the secured local broker needs java, keytool and mvn",
)


def common_set(conf: dict) -> str:
    """``--set kafka.common={...}``: librdkafka settings as a TOML inline table."""
    return "kafka.common={" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in conf.items()) + "}"


def code(exc: KafkaClientError) -> str:
    return exc.kafka_error.name() if exc.kafka_error is not None else ""


# ---- without a broker ------------------------------------------------------------------------
def test_sasl_ssl_needs_an_admin_user_and_safe_passwords():
    with pytest.raises(ConfigError, match=r"broker\.users\.admin"):
        load_config(None, ["broker.security=sasl_ssl"], environ={})
    with pytest.raises(ConfigError, match="password"):
        load_config(None, ["broker.security=sasl_ssl", 'broker.users={admin = "has,comma-1"}'], environ={})
    with pytest.raises(ConfigError, match="password"):
        load_config(None, ['broker.users={admin = "short"}'], environ={})
    with pytest.raises(ConfigError, match="user name"):
        load_config(None, ['broker.users={"a b" = "long-enough-1"}'], environ={})
    cfg = load_config(None, ["broker.security=sasl_ssl", 'broker.users={admin = "long-enough-1"}'], environ={})
    assert cfg.broker.security == "sasl_ssl" and load_config(None, [], environ={}).broker.security == "plaintext"


def test_kafka_common_security_settings_reach_every_client():
    """``kafka.common`` (here from the environment, as the Helm chart sets it) is in the settings of
    producers, consumers and admin clients alike."""
    from pipeline.kafka import client_conf

    sec = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "rollout",
        "sasl.password": "pw-rollout",
        "ssl.ca.location": "/etc/ca.pem",
    }
    env = {"RLSTREAM_KAFKA__COMMON": common_set(sec).split("=", 1)[1]}
    cfg = load_config(None, ['kafka.producer={"linger.ms" = 1}'], environ=env)
    for kind in ("producer", "consumer", "common"):
        conf = client_conf(cfg, "rollout", "w0", kind=kind)
        assert {k: conf[k] for k in sec} == sec


def test_java_client_properties_for_kafka_tools():
    props = java_client_properties(
        {
            "security.protocol": "sasl_ssl",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "admin",
            "sasl.password": 'p"w\\x',
            "ssl.ca.location": "/d/ca.pem",
            "ssl.endpoint.identification.algorithm": "none",
            "linger.ms": 5,
        }
    )
    assert props.splitlines() == [
        "security.protocol=SASL_SSL",
        "sasl.mechanism=SCRAM-SHA-512",
        'sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" '
        'password="p\\"w\\\\x";',
        "ssl.truststore.type=PEM",
        "ssl.truststore.location=/d/ca.pem",
        "ssl.endpoint.identification.algorithm=",
    ]
    assert java_client_properties({"linger.ms": 5}) == ""


def test_role_acls_are_least_privilege():
    cfg = load_config(None, ["topics.prefix=x."], environ={})
    acls = {role: {str(a) for a in lst} for role, lst in role_acls(cfg).items()}
    assert acls["rollout"] == {
        "allow User:rollout read topic:x.prompts",
        "allow User:rollout read group:rlstream-rollout",
        "allow User:rollout read topic:x.control",
        "allow User:rollout describe group:rlstream-nogroup-*",
        "allow User:rollout write topic:x.rollouts",
        "allow User:rollout write topic:x.metrics",
        "allow User:rollout write topic:x.dlq",
    }
    assert "allow User:reward write transactional_id:rlstream-reward-*" in acls["reward"]
    assert not any("cluster" in a or " all " in a for lst in acls.values() for a in lst)  # no cluster rights
    paced = role_acls(load_config(None, ["feed.dispatch=paced"], environ={}), {"feed": "User:f"})["feed"]
    assert "allow User:f describe group:rlstream-rollout" in {str(a) for a in paced}


# ---- a secured broker ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A local broker with ``security = "sasl_ssl"`` and one user per role, its topics created by
    admin, each role granted ``role_acls``, and a job config without credentials."""
    from pipeline.admin import Admin, ensure_topics
    from pipeline.config import cli_overrides, dump_toml, merge, settings_tree, validate
    from rlstream.broker import LocalBroker
    from rlstream.config import BrokerConfig, Config
    from rlstream.demo import demo_settings, write_task

    root = tmp_path_factory.mktemp("security")
    broker = LocalBroker(BrokerConfig(port=0, data_dir=root / "broker", heap_mb=512, security="sasl_ssl", users=USERS))
    state = broker.start(progress=lambda m: print(f"[secured broker] {m}"), owned=True)
    try:
        bootstrap = state["bootstrap"]
        write_task(root / "task.jsonl")
        sets = [
            "topics.prefix=sec.",
            f"kafka.bootstrap_servers={bootstrap}",
            f"run_dir={json.dumps(str(root / 'runs'))}",
            "feed.limit=40",
            "rl.max_staleness=1",
            *TINY,
        ]

        def config(*more):  # the demo's settings < these
            return validate(Config, merge(settings_tree(demo_settings(root, "sec")), cli_overrides([*sets, *more])))

        cfg = config()
        (root / "job.toml").write_text(dump_toml(cfg))
        admin_cfg = config(common_set(broker.client_conf("admin")))
        assert set(ensure_topics(admin_cfg).values()) == {"created"}
        admin = Admin({"bootstrap.servers": bootstrap, **broker.client_conf("admin")}, timeout=30)
        acls = role_acls(cfg)
        for lst in acls.values():
            admin.create_acls(lst)
        for role, lst in acls.items():
            assert set(admin.describe_acls(principal=f"User:{role}")) == set(lst)
        yield {"broker": broker, "state": state, "cfg": cfg, "admin": admin, "root": root}
        admin.close()
    finally:
        broker.stop(progress=lambda m: print(f"[secured broker] {m}"))
        shutil.rmtree(root, ignore_errors=True)


def role_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")} | {"PYTHONUNBUFFERED": "1"}


def role_argv(s: dict, role_cmd: list[str], user: str, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "rlstream", *role_cmd, "--config", str(s["root"] / "job.toml")]
    for item in (common_set(s["broker"].client_conf(user)), *sets):
        argv += ["--set", item]
    return argv


@pytest.mark.kafka
@pytest.mark.slow
@local_broker_tools
def test_broker_status_shows_the_security_mode_and_ca(secured):
    from tests.conftest import run_cli

    proc = run_cli(["broker", "status", "--set", f"broker.data_dir={secured['broker'].data_dir}"], role_env())
    state = json.loads(proc.stdout)
    assert state["security"] == "sasl_ssl" and state["security_protocol"] == "SASL_SSL"
    assert state["sasl_mechanism"] == "SCRAM-SHA-512" and Path(state["ca_location"]).is_file()
    assert set(state["users"]) == set(USERS)
    assert not any(pw in proc.stdout for pw in USERS.values())  # names only, never passwords
    tls = secured["broker"].tls_dir
    assert oct((tls / "password").stat().st_mode)[-3:] == "600"
    assert oct((secured["broker"].data_dir / "server.properties").stat().st_mode)[-3:] == "600"


@pytest.mark.kafka
@pytest.mark.slow
@local_broker_tools
def test_pipeline_runs_with_one_principal_per_role(secured):
    """feed, rollout, reward and trainer as real CLI processes, each with its own SCRAM user and
    only the ACLs of ``role_acls``: the trainer finishes its steps and publishes the versions."""
    from pipeline.control import ControlFollower
    from rlstream.kafka_tools import kafka_tool_argv

    root, cfg = secured["root"], secured["cfg"]
    roles = {
        "trainer": (["train", "--max-steps", "2"], "trainer"),
        "reward": (["reward"], "reward"),
        "rollout": (["rollout"], "rollout"),
        "feed": (["feed"], "feed"),
    }
    logs = {r: open(root / f"{r}.log", "w") for r in roles}
    procs = {
        r: subprocess.Popen(role_argv(secured, cmd, user), env=role_env(), stdout=logs[r], stderr=subprocess.STDOUT)
        for r, (cmd, user) in roles.items()
    }

    def log_of(role: str) -> str:
        return (root / f"{role}.log").read_text(errors="replace")[-4000:]

    try:
        deadline = time.monotonic() + 420
        while procs["trainer"].poll() is None and time.monotonic() < deadline:
            failed = {r: p.returncode for r, p in procs.items() if p.poll() not in (None, 0)}
            assert not failed, "\n".join(f"--- {r}:\n{log_of(r)}" for r in failed)
            time.sleep(1)
        assert procs["trainer"].poll() == 0, log_of("trainer")
        assert procs["feed"].wait(60) == 0, log_of("feed")
        for r in ("reward", "rollout"):  # a clean stop: SIGTERM, exit 0
            procs[r].send_signal(signal.SIGTERM)
        for r in ("reward", "rollout"):
            assert procs[r].wait(90) == 0, log_of(r)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
    for r in roles:
        assert "AUTHORIZATION_FAILED" not in log_of(r), log_of(r)

    admin_cfg = cfg.model_copy(deep=True)
    admin_cfg.kafka.common = secured["broker"].client_conf("admin")
    follower = ControlFollower(admin_cfg, "test")
    try:
        assert follower.catch_up(30)["version"] == 2
    finally:
        follower.close()

    # Kafka's own tools over SASL_SSL: kafka.common becomes the tool's --command-config.
    argv = kafka_tool_argv(
        "consumer-groups",
        ["--bootstrap-server", secured["state"]["bootstrap"], "--list"],
        secured["broker"].client_conf(),
    )
    props = Path(argv[argv.index("--command-config") + 1])
    try:
        assert "sasl.jaas.config=" in props.read_text() and oct(props.stat().st_mode)[-3:] == "600"
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        props.unlink(missing_ok=True)  # it holds the admin password
    assert out.returncode == 0, out.stderr[-2000:]
    assert {"rlstream-rollout", "rlstream-reward", "rlstream-trainer"} <= set(out.stdout.split())


@pytest.mark.kafka
@pytest.mark.slow
@local_broker_tools
def test_a_role_is_refused_where_it_has_no_right(secured):
    """The rollout principal, with the rollout ACLs, against everything it was not granted: each
    refusal is a typed error that names Kafka's authorization error, and none hangs."""
    from pipeline.admin import Acl, Admin
    from pipeline.kafka import Consumer, Producer

    cfg, broker = secured["cfg"], secured["broker"]
    rollout = {"bootstrap.servers": secured["state"]["bootstrap"], **broker.client_conf("rollout")}
    t = cfg.topics.name

    producer = Producer(rollout)  # write where it may not
    producer.produce(t("scored"), b"forged")
    with pytest.raises(DeliveryError) as exc:
        producer.flush(30)
    assert code(exc.value) == "TOPIC_AUTHORIZATION_FAILED" and t("scored") in str(exc.value)
    producer.close()

    with Consumer(rollout) as c, pytest.raises(KafkaClientError) as exc:  # read where it may not
        c.read_to_end(t("scored"), timeout=30)
    assert code(exc.value) == "TOPIC_AUTHORIZATION_FAILED"

    with Consumer(rollout, group_id=cfg.reward.group_id) as c:  # join another role's group
        c.subscribe([t("prompts")])
        deadline = time.monotonic() + 30
        with pytest.raises(ConsumeError) as exc:
            while time.monotonic() < deadline:
                c.consume(10, 0.5)
    assert code(exc.value) == "GROUP_AUTHORIZATION_FAILED"

    txn = Producer(rollout, transactional_id=f"{cfg.reward.transactional_id_prefix}-forged")
    with pytest.raises(KafkaClientError) as exc:  # use the reward workers' transactional ids
        txn.init_transactions(30)
    assert code(exc.value) == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"
    txn.abandon()

    admin = Admin(rollout, timeout=15)
    with pytest.raises(KafkaClientError) as exc:  # grant itself more
        admin.create_acls([Acl("User:rollout", "topic", t("scored"), "write")])
    assert code(exc.value) == "CLUSTER_AUTHORIZATION_FAILED"
    with pytest.raises(TopicError) as exc:  # create or delete topics
        admin.create_topics({f"{cfg.topics.prefix}forged": cfg.topics.dlq})
    assert code(exc.value) == "TOPIC_AUTHORIZATION_FAILED"
    with pytest.raises(TopicError) as exc:
        admin.delete_topics([t("prompts")])
    assert code(exc.value) == "TOPIC_AUTHORIZATION_FAILED"
    assert t("prompts") in secured["admin"].list_topics()


@pytest.mark.kafka
@pytest.mark.slow
@local_broker_tools
def test_clients_without_valid_credentials_cannot_connect(secured):
    """A PLAINTEXT client, a wrong password and a client that does not trust the broker's CA all
    fail within their timeout (the SASL_SSL port speaks nothing else)."""
    from pipeline.admin import Admin

    bootstrap, broker = secured["state"]["bootstrap"], secured["broker"]
    cases = {
        "plaintext": {},
        "wrong password": broker.client_conf("rollout", password="not-the-password"),
        "unknown CA": {k: v for k, v in broker.client_conf("rollout").items() if k != "ssl.ca.location"},
    }
    for what, conf in cases.items():
        t0 = time.monotonic()
        with pytest.raises(TopicError):
            Admin({"bootstrap.servers": bootstrap, **conf}, timeout=5).list_topics()
        assert time.monotonic() - t0 < 30, what
    assert Admin({"bootstrap.servers": bootstrap, **broker.client_conf("rollout")}, timeout=10).list_topics()


WRONG_IDENTITY = [  # (role, command, whose credentials it runs with)
    ("feed", ["feed"], "rollout"),
    ("trainer", ["train", "--max-steps", "1"], "feed"),
    ("rollout", ["rollout"], "reward"),
    ("reward", ["reward"], "rollout"),
]


@pytest.mark.kafka
@pytest.mark.slow
@local_broker_tools
@pytest.mark.parametrize(
    ("role", "cmd", "user"),
    WRONG_IDENTITY,
    ids=[f"{w[0]}-as-{w[2]}" for w in WRONG_IDENTITY],
)
def test_a_role_run_with_another_roles_credentials_exits_with_an_authorization_error(secured, role, cmd, user):
    """Not a hang and not a silent retry: a non-zero exit whose error line names the refusal."""
    root = secured["root"]
    # feed.limit is a total: the fixture's feed already published its 40, so lift it, or the feed
    # would rightly have nothing to write and exit 0
    sets = (f"run_dir={json.dumps(str(root / f'wrong-{role}'))}", "liveness.startup_timeout_s=20", "feed.limit=0")
    t0 = time.monotonic()
    proc = subprocess.run(
        role_argv(secured, cmd, user, *sets), env=role_env(), capture_output=True, text=True, timeout=180
    )
    elapsed = time.monotonic() - t0
    found = list(re.finditer(r"error: \w+: ", proc.stderr))  # the CLI's last word: "error: <Type>: ..."
    error = proc.stderr[found[-1].start() :] if found else ""
    print(f"[{role} as {user}] exit {proc.returncode} after {elapsed:.1f}s: {' '.join(error.split())[:400]}")
    assert proc.returncode != 0
    assert "AUTHORIZATION_FAILED" in error, (proc.stdout + proc.stderr)[-3000:]
    assert elapsed < 90


@pytest.mark.kafka
@pytest.mark.slow
@local_broker_tools
def test_users_and_acls_can_be_added_listed_and_revoked(secured):
    """The admin side: a SCRAM user added on a running broker can connect at once; an ACL is in
    effect when ``create_acls`` returns, and ``delete_acls`` revokes it."""
    from pipeline.admin import Acl, Admin

    admin, bootstrap, broker = secured["admin"], secured["state"]["bootstrap"], secured["broker"]
    admin.upsert_scram_users({"eval": "eval-Secret-5"})
    evaluator = Admin({"bootstrap.servers": bootstrap, **broker.client_conf("eval", "eval-Secret-5")}, timeout=10)
    assert evaluator.list_topics() == set()  # authenticated, and allowed nothing
    grant = Acl("User:eval", "topic", secured["cfg"].topics.prefix, "read", "prefixed")
    assert admin.create_acls([grant]) == 1
    assert admin.describe_acls(principal="User:eval") == [grant]
    assert set(evaluator.list_topics()) == {secured["cfg"].topics.name(r) for r in secured["cfg"].topics.specs()}
    assert admin.delete_acls(principal="User:eval") == [grant]
    assert admin.describe_acls(principal="User:eval") == []
