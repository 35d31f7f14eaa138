"""Sharded weight checkpoints without a broker: HF's sharded layout round-trips and is readable by
safetensors itself; a corrupted, truncated or foreign shard is refused naming the shard; the index
is written last; single-file notices (old writers, v1 notices) read as before; ``publish_hf``
version directories load with ``from_pretrained`` and give the trainer's logits; the hf rollout
engine stages a sharded version and swaps it in; gc deletes sharded versions whole; stores other
than the local disk read the same."""

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from consumers.trainer.engines import TrainContext, build_engine  # noqa: E402
from consumers.trainer.publish import write_version  # noqa: E402
from pipeline import checkpoint  # noqa: E402
from pipeline.checkpoint import (  # noqa: E402
    INDEX_FILE,
    ChecksumError,
    gc_versions,
    iter_weights,
    read_bytes_verified,
    read_weights,
    verify_checkpoint,
    write_weights,
)
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.models import load_tokenizer, materialize  # noqa: E402
from pipeline.records import HF_DIR_KEY  # noqa: E402
from rlstream.config import load_config  # noqa: E402
from tests.test_deepspeed import TINY  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def state(n: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.{i}.w": torch.randn(64, 48, generator=g) for i in range(n)}
    sd["model.norm.weight"] = torch.randn(7, generator=g).to(torch.bfloat16)  # 14 bytes: odd sizes in a shard
    sd["model.embed.weight"] = torch.randn(33, 5, generator=g).to(torch.float16)
    sd["counter"] = torch.arange(3, dtype=torch.int64)
    sd["flag"] = torch.tensor(True)
    sd["empty"] = torch.zeros(0, 4)
    return sd


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_sharded_round_trip_in_hf_layout(tmp_path):
    from safetensors import safe_open

    sd = state()
    uri, sha, nbytes = write_weights(str(tmp_path), 3, sd, shard_bytes=30_000)
    vdir = tmp_path / "v00000003"
    assert uri == str(vdir / INDEX_FILE) and checkpoint.weights_format(uri) == "safetensors-sharded"
    assert sha == hashlib.sha256(Path(uri).read_bytes()).hexdigest()
    shards = sorted(p.name for p in vdir.glob("*.safetensors"))
    assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
    assert nbytes == sum(p.stat().st_size for p in vdir.iterdir())
    index = json.loads(Path(uri).read_text())
    assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(shards)
    manifest = index["metadata"]["rlstream.shards"]
    for name in shards:  # the manifest: each shard's own sha256 and size
        data = (vdir / name).read_bytes()
        assert manifest[name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert not list(vdir.glob("*.tmp-*"))

    assert_same(read_weights(uri, sha), sd)
    seen = {}
    for name, tensors in iter_weights(uri, sha, threads=2, ahead=1):
        assert all(index["weight_map"][k] == name for k in tensors)  # one verified shard at a time
        seen.update(tensors)
    assert_same(seen, sd)
    for name in shards:  # safetensors (and so transformers, vLLM) reads every shard
        with safe_open(str(vdir / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert torch.equal(f.get_tensor(k), sd[k]), k
    assert verify_checkpoint(uri, sha) == nbytes - Path(uri).stat().st_size
    assert read_bytes_verified(uri, sha) == Path(uri).read_bytes()


def test_small_state_dicts_stay_one_file_and_old_notices_read(tmp_path):
    from safetensors.torch import save

    from libs.engines.base import Engine
    from libs.engines.sim import SimEngine
    from producers.weights import check_loadable

    sd = state(2)
    uri, sha, nbytes = write_weights(str(tmp_path), 1, sd, shard_bytes=1 << 20)
    assert uri.endswith("/v00000001/model.safetensors") and checkpoint.weights_format(uri) == "safetensors"
    assert nbytes == Path(uri).stat().st_size
    assert_same(read_weights(uri, sha), sd)
    # a file of the old writer (safetensors.torch.save, no metadata), named by a v1 notice (no format)
    old = {k: v for k, v in sd.items() if k != "empty"}
    data = save(old)
    path = tmp_path / "old" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(data)
    notice = {"version": 2, "uri": str(path), "sha256": hashlib.sha256(data).hexdigest()}
    check_loadable(notice, SimEngine.__new__(SimEngine))
    assert_same(Engine.prepare_weights(SimEngine.__new__(SimEngine), notice), old)
    with pytest.raises(ChecksumError, match="does not match"):
        read_weights(str(path), "0" * 64)


def test_a_bad_shard_is_refused_naming_it(tmp_path):
    sd = state()
    uri, sha, _ = write_weights(str(tmp_path), 1, sd, shard_bytes=30_000)
    vdir = Path(uri).parent
    victim = vdir / "model-00002-of-00003.safetensors"
    good = victim.read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    victim.write_bytes(bytes(flipped))
    for call in (
        lambda: read_weights(uri, sha),
        lambda: list(iter_weights(uri, sha)),
        lambda: verify_checkpoint(uri, sha),
        lambda: read_bytes_verified(uri, sha),
    ):
        with pytest.raises(ChecksumError, match=r"shard model-00002-of-00003\.safetensors .*sha256"):
            call()
    victim.write_bytes(good[:-10])  # truncated: refused before it is read
    with pytest.raises(ChecksumError, match=r"model-00002-of-00003\.safetensors .*bytes"):
        read_weights(uri, sha)
    victim.write_bytes(good)
    assert_same(read_weights(uri, sha), sd)
    with pytest.raises(ChecksumError, match=r"index|does not match"):  # the notice's sha256 covers the index
        read_weights(uri, hashlib.sha256(b"another index").hexdigest())
    index = json.loads(Path(uri).read_text())
    del index["metadata"]["rlstream.shards"]
    foreign = tmp_path / "foreign" / INDEX_FILE
    foreign.parent.mkdir()
    foreign.write_text(json.dumps(index))
    with pytest.raises(ChecksumError, match="manifest"):
        read_weights(str(foreign), hashlib.sha256(foreign.read_bytes()).hexdigest())


def test_the_index_is_written_last(tmp_path, monkeypatch):
    sd = state(12)
    index = tmp_path / "v00000001" / INDEX_FILE
    events = []
    real = checkpoint._write_file

    def write_file(uri, tensors, metadata):
        assert not index.exists(), "a shard was written after the index"
        out = real(uri, tensors, metadata)
        events.append(("shard", Path(uri).name))
        return out

    monkeypatch.setattr(checkpoint, "_write_file", write_file)
    stop, seen = threading.Event(), []

    def reader():  # whenever the index is visible, the whole checkpoint reads and verifies
        while not stop.is_set():
            if index.exists():
                seen.append(len(read_weights(str(index), hashlib.sha256(index.read_bytes()).hexdigest())))
                return
            time.sleep(0.0005)

    t = threading.Thread(target=reader)
    t.start()
    try:
        write_weights(str(tmp_path), 1, sd, shard_bytes=25_000, threads=3)
    finally:
        t.join(timeout=30)
        stop.set()
    assert len(events) == len(json.loads(index.read_text())["metadata"]["rlstream.shards"]) >= 4
    assert seen == [len(sd)]


def tiny_trainer(*extra):
    cfg = load_config(None, [*TINY, *extra], environ={})
    d = materialize(cfg.model)
    eng = build_engine(cfg.trainer.engine, TrainContext(d, cfg.trainer))
    with torch.no_grad():  # "trained" weights: not the version-0 model
        g = torch.Generator().manual_seed(1)
        for p in eng.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return cfg, d, eng


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_publish_hf_directories_load_with_from_pretrained_and_in_the_hf_engine(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libs.engines import EngineContext
    from libs.engines import build_engine as build_rollout_engine
    from producers.config import HFEngineConfig

    cfg, d, eng = tiny_trainer("trainer.publish_hf=true", "trainer.shard_bytes=8192")
    upd = write_version(eng, eng.state_dict(), str(tmp_path / "store"), 1, 1, cfg.trainer, 4)
    hf_dir = upd["metadata"][HF_DIR_KEY]
    assert upd["format"] == "safetensors-sharded" and upd["uri"] == f"{hf_dir}/{INDEX_FILE}"
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(hf_dir)
    )
    want = logits(eng.module)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert torch.equal(logits(model), want)
    text = "Copy: apple\n"
    assert AutoTokenizer.from_pretrained(hf_dir)(text).input_ids == load_tokenizer(d)(text).input_ids

    rollout = build_rollout_engine(HFEngineConfig(device="cpu"), EngineContext(d, load_tokenizer(d), "w"))
    assert not torch.equal(logits(rollout.model), want)
    prepared = rollout.prepare_weights(upd)
    rollout.load_weights(upd, prepared)
    assert rollout.version == 1 and torch.equal(logits(rollout.model), want)
    # the load was a swap: the engine now holds the staged tensors themselves
    name = "model.layers.0.mlp.down_proj.weight"
    assert rollout.model.state_dict()[name].data_ptr() == prepared[name].data_ptr()

    bad = {**prepared, name: prepared[name][:, :-1]}  # a checkpoint of another shape: refused, nothing moves
    with pytest.raises(ValueError, match="does not fit"):
        rollout.load_weights({**upd, "version": 2}, bad)
    assert rollout.version == 1 and torch.equal(logits(rollout.model), want)

    # without publish_hf: no HF files, no hf_dir; below shard_bytes: one file
    cfg2, _, eng2 = tiny_trainer()
    upd2 = write_version(eng2, eng2.state_dict(), str(tmp_path / "store2"), 1, 1, cfg2.trainer, 0)
    assert upd2["format"] == "safetensors" and HF_DIR_KEY not in upd2["metadata"]
    assert os.listdir(Path(upd2["uri"]).parent) == ["model.safetensors"]
    with pytest.raises(ConfigError, match="publish_hf"):
        load_config(None, [*TINY, "trainer.publish_hf=true", "trainer.lora.rank=4"], environ={})


def test_gc_deletes_sharded_versions_whole(tmp_path):
    sd = state(4)
    store = str(tmp_path / "store")
    uris = [write_weights(store, v, sd, shard_bytes=20_000)[0] for v in range(1, 5)]
    assert all(u.endswith(INDEX_FILE) for u in uris)
    deleted = gc_versions(store, keep=2)
    assert [Path(p).name for p in deleted] == ["v00000001", "v00000002"]
    assert sorted(os.listdir(store)) == ["v00000003", "v00000004"]
    assert_same(read_weights(uris[-1]), sd)


def test_a_store_that_is_not_local_disk_reads_into_buffers():
    """fsspec stores other than the local disk (here ``memory://``; s3, gcs, ...) are not
    memory-mapped but read into this process's buffers, verified the same way."""
    sd = state(5)
    store = f"memory://rlstream-test-{os.getpid()}"
    try:
        uri, sha, _ = write_weights(store, 1, sd, shard_bytes=20_000)
        assert uri.endswith(INDEX_FILE)
        assert_same(read_weights(uri, sha), sd)
        with pytest.raises(ChecksumError, match=r"does not match"):
            read_weights(uri, "0" * 64)
    finally:
        gc_versions(store, 0)
