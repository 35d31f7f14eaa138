"""Every Command on rl.control that a role acts on is authenticated like a weight notice: a forged
feed state (unsigned, or signed with another key) does not move where the feed resumes, and a
forged progress record does not move admission; both are skipped, counted and dead-lettered."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

from pipeline import control
from pipeline.control import ControlFollower, admission_limit, now_ms
from pipeline.kafka import Producer, client_conf
from pipeline.notice_auth import sign
from producers import feed
from tests.rollout_helpers import read_topic

DATA = "tests/data/prompts.jsonl"


def _produce(cfg, rec: dict, key: str) -> None:
    p = Producer(client_conf(cfg, "forger", kind="producer"))
    try:
        p.produce_record(cfg.topics.name("control"), "Command", rec, key=key)
        p.flush(30)
    finally:
        p.close(30)


def _state(next_g: int, sha: str) -> dict:
    args = {"feed": "default", "next_group_seq": str(next_g), "dataset_sha256": sha, "records": "12", "offsets": "{}"}
    return {"name": feed.STATE_COMMAND, "args": args, "issued_by": "feed/default", "created_at_ms": now_ms()}


@pytest.mark.kafka
def test_a_forged_feed_state_is_ignored_and_the_feed_resumes_exactly(make_config):
    from pipeline.notice_auth import ensure_key

    cfg = make_config(f"feed.source={DATA}", "feed.limit=5", "feed.checkpoint_every=2")
    ensure_key(cfg.store)  # as `rlstream run` does before any role starts
    assert feed.run(cfg)["messages"] == 5
    genuine = feed.read_state(cfg, "default")
    assert genuine is not None and genuine["next_group_seq"] == 5
    # forged states: unsigned, and signed with a key that is not the job's; both claim group 10
    _produce(cfg, _state(10, genuine["dataset_sha256"]), "feed/default")
    _produce(cfg, sign(_state(11, genuine["dataset_sha256"]), os.urandom(32), 0), "feed/default")
    # a forged state with another dataset hash would stop the feed (a changed dataset)
    _produce(cfg, _state(12, "0" * 64), "feed/default")
    assert feed.read_state(cfg, "default") == genuine
    cfg.feed.limit = 8
    stats = feed.run(cfg)
    assert (stats["start_group_seq"], stats["messages"]) == (5, 3)
    seqs = collections.Counter(r["group_seq"] for _, r in read_topic(cfg, "prompts", "Prompt", 8))
    assert sorted(seqs) == list(range(8)) and set(seqs.values()) == {1}
    follower = ControlFollower(cfg, "check")
    try:
        follower.catch_up(30)
        assert follower.refused_commands == 3
        states = [int(c["args"]["next_group_seq"]) for c in follower.commands]
        assert states[2] == 5 and states[-1] == 8 and states == sorted(states)  # only the feed's own
    finally:
        follower.close()
    dlq = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 3)]
    assert {d["error_type"] for d in dlq} == {"unsigned_notice", "bad_signature"}


@pytest.mark.kafka
def test_a_forged_progress_record_does_not_move_admission(make_config, caplog):
    cfg = make_config()
    from pipeline.notice_auth import ensure_key

    key = ensure_key(cfg.store)
    args = {"version": "0", "consumed_groups": "1000", "trainer_id": "trainer-0"}
    forged = {"name": control.PROGRESS_COMMAND, "args": args, "issued_by": "trainer-0", "created_at_ms": now_ms()}
    for _ in range(3):
        _produce(cfg, forged, "progress")
    _produce(cfg, sign({**forged, "args": {**args, "consumed_groups": "2000"}}, os.urandom(32), 9), "progress")
    genuine = sign({**forged, "args": {**args, "consumed_groups": "7"}}, key, 1)
    _produce(cfg, genuine, "progress")
    follower = ControlFollower(cfg, "rollout")
    try:
        with caplog.at_level("WARNING"):
            follower.catch_up(30)
        assert follower.consumed_groups(0) == 7
        assert follower.admission_limit(0, 1, 4) == admission_limit(0, 1, 4, 7)
        assert follower.refused_commands == 4
        warnings = [r for r in caplog.records if "fail authentication" in r.getMessage()]
        assert len(warnings) == 2  # once per command name and error, not once per record
    finally:
        follower.close()
    assert json.dumps(follower.commands[-1]["args"]["consumed_groups"]) == '"7"'


def _notice(v: int, **fields) -> dict:
    rec = {"version": v, "uri": f"/store/v{v:08d}/model.safetensors", "sha256": "ab" * 32, "bytes": 1, "step": v}
    return {**rec, "created_at_ms": now_ms(), "trainer_id": "trainer-0", "metadata": {}, **fields}


@pytest.mark.kafka
def test_a_notice_without_sha256_is_refused(make_config):
    from pipeline.notice_auth import NoticeSigner

    cfg = make_config()
    signer = NoticeSigner.start(cfg.store)
    p = Producer(client_conf(cfg, "trainer", kind="producer"))
    try:
        for rec in (_notice(1, sha256=""), _notice(1)):
            control.publish_weight_update(p, cfg.topics.name("control"), signer.sign(rec))
    finally:
        p.close(30)
    follower = ControlFollower(cfg, "rollout")
    try:
        follower.catch_up(30)
        assert follower.latest_update["sha256"] == "ab" * 32 and follower.dead_lettered == 1
    finally:
        follower.close()
    assert [r["error_type"] for _, r in read_topic(cfg, "dlq", "DeadLetter", 1)] == ["missing_sha256"]


def test_an_unreadable_key_refuses_unsigned_notices(tmp_path):
    from pipeline.errors import RlstreamError
    from pipeline.notice_auth import NoticeVerifier, notice_key_uri

    store = str(tmp_path / "store")
    os.makedirs(notice_key_uri(store))  # there, but not readable as a key
    with pytest.raises(RlstreamError, match="cannot read the notice key") as err:
        NoticeVerifier(store).check()
    assert "\n" not in str(err.value)
    assert NoticeVerifier(store, tries=1).problem(_notice(1))[0] == "unverifiable_signature"
    # a store without a key (a job of an older rlstream) still accepts unsigned notices
    assert NoticeVerifier(str(tmp_path / "other"), tries=1).problem(_notice(1)) is None


@pytest.mark.kafka
def test_a_role_refuses_to_start_on_an_unreadable_key(make_config, cli_env, tmp_path):
    import time

    from pipeline.notice_auth import notice_key_uri
    from tests.conftest import run_cli

    cfg = make_config()
    os.makedirs(notice_key_uri(cfg.store))
    t0 = time.monotonic()
    proc = run_cli(["feed", os.path.abspath(DATA)], cli_env, check=False)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "notice key" in line]
    assert proc.returncode != 0 and len(lines) == 1 and "cannot read the notice key" in lines[0]
    assert time.monotonic() - t0 < 60


def test_a_key_the_store_fails_to_return_for_a_while_is_retried_at_start(tmp_path, monkeypatch, caplog):
    """A store that answers with I/O errors for a while (an object store's outage) does not stop a
    role's start: the key is read again with backoff until the store answers (within the bound)."""
    import threading

    from pipeline import faultfs
    from pipeline.notice_auth import NoticeVerifier, ensure_key

    orders = tmp_path / "orders.json"
    monkeypatch.setenv(faultfs.ENV, str(orders))
    store = f"faultfile://{tmp_path / 'store'}"
    key = ensure_key(store)
    faultfs.write_orders(orders, {"fail": True})
    verifier, errors = NoticeVerifier(store), []

    def check():
        try:
            verifier.check(deadline_s=120)
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=check, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while "cannot read the notice key yet" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "cannot read the notice key yet" in caplog.text and t.is_alive()
    faultfs.write_orders(orders, None)
    t.join(60)
    assert not t.is_alive() and not errors and verifier.key == key
