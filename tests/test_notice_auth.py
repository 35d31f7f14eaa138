"""Weight notices carry a verifiable writer identity (``pipeline.notice_auth``).
Sign and verify (every field is covered), the key in the store (created once, 0600, reused), the
writer epoch (bumped at each start; an older epoch is refused after a newer one), and a follower on
a real broker refusing a replaced trainer's notice and unsigned or forged ones."""

from __future__ import annotations

import os
import stat
import time

import pytest

from pipeline import checkpoint, codec, control
from pipeline.kafka import Producer, client_conf
from pipeline.notice_auth import EPOCH_KEY, SIG_KEY, NoticeSigner, NoticeVerifier, load_key, sign, verified


def _notice(v: int = 3, **fields) -> dict:
    rec = {
        "version": v,
        "uri": f"/store/v{v:08d}/adapter_model.safetensors",
        "sha256": "ab" * 32,
        "bytes": 1234,
        "step": v,
        "created_at_ms": 1_700_000_000_000,
        "format": "safetensors",
        "trainer_id": "trainer-0",
        "metadata": {"engine": "hf"},
        "kind": "adapter",
        "adapter_rank": 8,
        "adapter_alpha": 16,  # an int here: Avro gives a reader 16.0, which must verify the same
        "adapter_target_modules": ["q_proj", "v_proj"],
        "base_sha256": "cd" * 32,
        "consumed_groups": 12,
    }
    return {**rec, **fields}


TAMPER = {
    "version": 4,
    "uri": "/elsewhere/model.safetensors",
    "sha256": "ef" * 32,
    "bytes": 1235,
    "step": 4,
    "created_at_ms": 1,
    "format": "safetensors-sharded",
    "trainer_id": "trainer-1",
    "kind": "full",
    "adapter_rank": 16,
    "adapter_alpha": 32.0,
    "adapter_target_modules": ["q_proj"],
    "base_sha256": "00" * 32,
    "consumed_groups": 13,
}


def test_sign_verify_every_field_is_covered(tmp_path):
    store = str(tmp_path / "store")
    signer = NoticeSigner.start(store)
    good = signer.sign(_notice())
    assert good["metadata"][EPOCH_KEY] == "1" and len(good["metadata"][SIG_KEY]) == 64
    assert NoticeVerifier(store).problem(good) is None
    # through Avro and back (as a reader gets it) it still verifies
    _, back = codec.decode(codec.encode("WeightUpdate", good))
    assert back["adapter_alpha"] == 16.0 and NoticeVerifier(store).problem(back) is None
    assert set(TAMPER) | {"metadata"} == set(_notice()), "a field of the notice is not tampered with here"
    for field, value in TAMPER.items():
        assert NoticeVerifier(store).problem({**good, field: value})[0] == "bad_signature", field
    meta = good["metadata"]
    for forged in (
        {**meta, "engine": "vllm"},  # a metadata value changed
        {**meta, "hf_dir": "/evil"},  # a metadata entry added
        {k: v for k, v in meta.items() if k != "engine"},  # one removed
        {**meta, EPOCH_KEY: "7"},  # the epoch raised
        {**meta, EPOCH_KEY: "x"},  # not a number
        {**meta, SIG_KEY: "0" * 64},  # the signature replaced
    ):
        assert NoticeVerifier(store).problem({**good, "metadata": forged})[0] == "bad_signature", forged
    # unsigned: refused once the store has a key
    unsigned = NoticeVerifier(store).problem(_notice())
    assert unsigned[0] == "unsigned_notice" and "no signature" in unsigned[1]
    # signed with another key (a writer that made up its own): refused
    other = sign(_notice(), os.urandom(32), 1)
    assert NoticeVerifier(store).problem(other)[0] == "bad_signature"


def test_progress_commands_are_signed_too(tmp_path):
    store = str(tmp_path / "store")
    signer = NoticeSigner.start(store)
    args = {"version": "3", "consumed_groups": "40", "trainer_id": "trainer-0"}
    rec = {"name": control.PROGRESS_COMMAND, "args": args, "issued_by": "trainer-0", "created_at_ms": 5}
    good = signer.sign(rec)
    assert NoticeVerifier(store).problem(good) is None and good["args"][EPOCH_KEY] == "1"
    for forged in (
        {**good, "args": {**good["args"], "consumed_groups": "4000"}},
        {**good, "args": {**good["args"], "version": "4"}},
        {**good, "issued_by": "x"},
        {**good, "created_at_ms": 6},
        {**good, "name": "stop"},
    ):
        assert NoticeVerifier(store).problem(forged)[0] == "bad_signature", forged
    assert NoticeVerifier(store).problem(rec)[0] == "unsigned_notice"


def test_key_is_created_once_private_and_reused_and_the_epoch_grows(tmp_path):
    store = str(tmp_path / "store")
    assert load_key(store) is None
    first = NoticeSigner.start(store)
    path = tmp_path / "store" / "notice" / "key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_bytes()) == 32
    again = NoticeSigner.start(store)  # a restarted trainer
    assert again.key == first.key and (first.epoch, again.epoch) == (1, 2)
    assert not checkpoint.create_exclusive(checkpoint.notice_key_uri(store), b"x" * 32)  # never replaced
    assert load_key(store) == first.key
    assert NoticeSigner.start(str(tmp_path / "old"), create=False) is None  # an older job: no key made
    checkpoint.gc_versions(store, keep=0)  # version gc never deletes the key
    assert load_key(store) == first.key
    assert not list((tmp_path / "store").rglob("*.tmp-*"))


def test_stale_epoch_and_a_store_without_a_key(tmp_path):
    store = str(tmp_path / "store")
    old, new = NoticeSigner.start(store), NoticeSigner.start(store)
    v = NoticeVerifier(store)
    a, b, zombie = old.sign(_notice(1)), new.sign(_notice(2)), old.sign(_notice(3))
    for rec in (a, b):
        assert v.problem(rec) is None
        v.note(rec)
    assert v.problem(zombie)[0] == "stale_writer_epoch"
    assert verified(store, [a, b, zombie, _notice(4)]) == [a, b]
    # no key (a job of an older rlstream): unsigned notices pass; a signed one cannot be verified,
    # after a bounded wait for the key the first time and none afterwards
    legacy = NoticeVerifier(str(tmp_path / "legacy"), tries=3, retry_s=0.05)
    assert legacy.problem(_notice()) is None
    t0 = time.monotonic()
    assert legacy.problem(a)[0] == "unverifiable_signature"
    assert 0.15 <= time.monotonic() - t0 < 5
    t0 = time.monotonic()
    assert legacy.problem(a)[0] == "unverifiable_signature" and time.monotonic() - t0 < 0.1


@pytest.mark.kafka
def test_follower_refuses_unsigned_forged_and_replaced_writers(make_config):
    """An independent writer (its own producer) on a real control topic: the job's trainer at epoch
    2, then a zombie at epoch 1, an unsigned notice and one with a made-up signature, all at the
    next version, and an unsigned progress record: each is dead-lettered with its reason and the
    follower stays at epoch 2's v1 and the trainer's consumed-group count."""
    from tests.rollout_helpers import read_topic

    cfg = make_config()
    topic = cfg.topics.name("control")
    zombie, trainer = NoticeSigner.start(cfg.store), NoticeSigner.start(cfg.store)
    forged = {**_notice(2), "metadata": {"engine": "hf", EPOCH_KEY: "9", SIG_KEY: "f" * 64}}
    with Producer(client_conf(cfg, "intruder", kind="producer")) as p:
        for rec in (trainer.sign(_notice(1)), zombie.sign(_notice(2)), _notice(2), forged):
            control.publish_weight_update(p, topic, rec)
        control.publish_progress(p, topic, 1, 20, "trainer-0", sign=trainer.sign)
        control.publish_progress(p, topic, 1, 9999, "trainer-0")  # unsigned: admission does not move
    f = control.ControlFollower(cfg, "test")
    try:
        latest = f.catch_up(timeout=30)
        assert latest["version"] == 1 and f.auth.epoch == 2 and f.dead_lettered == 4
        assert f.consumed_groups(1) == 20
        with Producer(client_conf(cfg, "trainer", kind="producer")) as p:
            control.publish_weight_update(p, topic, trainer.sign(_notice(2)))
        assert f.wait_for_version(2, timeout=20)["version"] == 2
    finally:
        f.close()
    dl = read_topic(cfg, "dlq", "DeadLetter", min_count=4)
    assert [d["error_type"] for _, d in dl] == [
        "stale_writer_epoch",
        "unsigned_notice",
        "bad_signature",
        "unsigned_notice",
    ]
    assert all(d["reason"] and d["role"] == "test" for _, d in dl)


@pytest.mark.kafka
def test_rlstream_run_creates_the_key_of_a_fresh_job_before_any_role_starts(make_config, tmp_path):
    """No reader ever sees a fresh job without a key (it would accept unsigned notices until the
    trainer's first start); a resumed job of an older rlstream (a checkpoint, no key) stays unsigned."""
    from consumers.trainer.state import POINTER, trainer_root
    from rlstream.launcher import Launcher, standard_roles

    def prepare(cfg, run_dir):
        run_dir.mkdir()
        roles = standard_roles(cfg, 1, 1)
        Launcher(cfg, run_dir, roles, title="t", live=False, console=None).prepare()

    fresh = make_config(f"checkpoint_store={tmp_path / 'fresh'}", create=False)
    assert load_key(fresh.store) is None
    prepare(fresh, tmp_path / "run-fresh")
    key = load_key(fresh.store)
    assert key is not None and NoticeSigner.start(fresh.store, create=False).key == key  # the trainer's

    old = make_config(f"checkpoint_store={tmp_path / 'old'}", f"trainer.checkpoint_dir={tmp_path / 'ck'}", create=False)
    trainer_root(old).mkdir(parents=True)
    (trainer_root(old) / POINTER).write_text('{"tag": "step-00000003"}')
    prepare(old, tmp_path / "run-old")
    assert load_key(old.store) is None
