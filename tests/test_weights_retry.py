"""A rollout worker's weight fetch (``producers.weights.WeightSync``) against a real broker: a
genuine notice whose checkpoint is not there yet is retried with backoff, said in the log, and
used once it appears; one a newer notice supersedes is dead-lettered and the newer one loaded."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from pipeline import control
from pipeline.checkpoint import read_weights, write_weights
from pipeline.control import now_ms
from pipeline.kafka import Producer, client_conf
from pipeline.notice_auth import NoticeSigner
from producers.weights import WeightSync
from tests.rollout_helpers import read_topic


class StoreEngine:
    """The part of a rollout engine weight sync uses: read and verify a checkpoint, swap it in."""

    name = "store"
    weight_formats = frozenset({"safetensors"})
    weight_kinds = frozenset({"full"})

    def __init__(self):
        self.version, self.weights = 0, None

    def prepare_weights(self, update: dict):
        return read_weights(update["uri"], update["sha256"])

    def load_weights(self, update: dict, prepared) -> None:
        self.version, self.weights = update["version"], prepared


def _publish(cfg, signer, version: int, uri: str, sha: str, nbytes: int) -> None:
    rec = {"version": version, "uri": uri, "sha256": sha, "bytes": nbytes, "step": version}
    rec = signer.sign({**rec, "created_at_ms": now_ms(), "trainer_id": "trainer-0", "metadata": {}})
    p = Producer(client_conf(cfg, "trainer", kind="producer"))
    try:
        control.publish_weight_update(p, cfg.topics.name("control"), rec)
    finally:
        p.close(30)


def _until(sync: WeightSync, cond, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        sync.poll()
        sync.wait_fetch(0.2) or time.sleep(0.05)


@pytest.mark.kafka
def test_weights_that_appear_late_are_retried_and_used(make_config, tmp_path, caplog):
    cfg = make_config()
    signer = NoticeSigner.start(cfg.store)
    uri, sha, nbytes = write_weights(cfg.store, 1, {"w": torch.arange(6.0)})
    hidden = str(tmp_path / "hidden.safetensors")
    os.replace(uri, hidden)  # announced, but not in the store yet
    _publish(cfg, signer, 1, uri, sha, nbytes)
    sync = WeightSync(cfg, "w0", StoreEngine())
    appeared = threading.Event()

    def land_late() -> None:  # the store shows the file after three failed tries
        deadline = time.monotonic() + 300
        while sync.fetch_failures < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.replace(hidden, uri)
        appeared.set()

    lander = threading.Thread(target=land_late, daemon=True)
    try:
        with caplog.at_level("WARNING"):
            sync.catch_up(30)
            lander.start()
            _until(sync, lambda: sync.loadable is not None, "the weights to become loadable")
        assert appeared.is_set() and sync.fetch_failures >= 3
        upd, _, _ = sync.load()
        assert upd["version"] == 1 and sync.engine.version == 1
        assert torch.equal(sync.engine.weights["w"], torch.arange(6.0))
        said = [r.getMessage() for r in caplog.records if "unavailable at" in r.getMessage()]
        assert any(f"weights v1 unavailable at {uri} (retrying, 3 tries)" in m for m in said), said
        assert sync.control.dead_lettered == 0
    finally:
        lander.join(30)
        sync.close()


@pytest.mark.kafka
def test_unavailable_weights_are_superseded_by_a_newer_version(make_config):
    cfg = make_config()
    signer = NoticeSigner.start(cfg.store)
    _publish(cfg, signer, 1, os.path.join(cfg.store, "v00000001", "model.safetensors"), "ab" * 32, 10)
    sync = WeightSync(cfg, "w0", StoreEngine())
    try:
        sync.catch_up(30)
        _until(sync, lambda: sync.fetch_failures >= 1, "a failed fetch")
        uri, sha, nbytes = write_weights(cfg.store, 2, {"w": torch.ones(3)})
        _publish(cfg, signer, 2, uri, sha, nbytes)
        _until(sync, lambda: sync.loadable is not None, "v2 to become loadable")
        assert sync.load()[0]["version"] == 2
    finally:
        sync.close()
    dl = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 1)]
    assert [d["error_type"] for d in dl] == ["unverifiable_checkpoint"] and "superseded" in dl[0]["reason"]
