"""Writing one published weights version and the WeightUpdate that announces it (rank 0).

Full fine-tuning writes ``<store>/v<version>/`` with ``pipeline.checkpoint.write_weights``
(``kind = "full"``): one ``model.safetensors`` (format ``safetensors``) or, above
``trainer.shard_bytes``, HF's sharded layout written in parallel with its index last (format
``safetensors-sharded``, the notice names the index). With ``trainer.publish_hf`` the model's
config and tokenizer files are copied into the version directory first, so it is a Hugging Face
model directory, announced as ``metadata["hf_dir"]``. LoRA (``trainer.lora``) writes only the
adapter in PEFT's layout (``kind = "adapter"``, with its rank, alpha, target modules and the
fingerprint of the base model it was trained on). Either way every file is completely written
before the notice exists, and the notice carries the trainer's consumed-group count
(``consumed_groups``, admission control: pipeline.control). ``start_signer``: the signer of this
start's notices (the job's notice key and a new writer epoch: ``pipeline.notice_auth``).

With a ``guard`` (``pipeline.store_guard.StoreGuard``) the write rides out storage faults: on a
full disk or a failing store the version directory is removed (no notice names it: the previous
version stays live), the fault is said on screen, and the write is tried again until it succeeds
or its bound is spent.

What this is not: the order of the checkpoint protocol (``worker.Trainer._checkpoint``) nor the
publishing call itself (``pipeline.control.publish_weight_update``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.checkpoint import (
    FORMAT,
    notice_key_uri,
    remove_version,
    version_dir,
    weights_format,
    write_adapter,
    write_hf_files,
    write_weights,
)
from pipeline.control import now_ms
from pipeline.errors import RlstreamError
from pipeline.log import kv
from pipeline.notice_auth import NoticeSigner, is_signed
from pipeline.records import HF_DIR_KEY, adapter_fields

log = logging.getLogger(__name__)
"""``WeightUpdate.metadata`` key naming the version's HF model directory (``trainer.publish_hf``)."""


def base_model_dir(engine, model_dir=None) -> Path:
    """The HF directory the trainer's model came from: ``model_dir`` if given, else the one the
    engine loaded it from (``engine.name_or_path``)."""
    path = model_dir or engine.name_or_path
    if not path or not (Path(path) / "config.json").is_file():
        raise RlstreamError(
            f"trainer.publish_hf: cannot find the model directory to copy config and tokenizer from ({path!r})"
        )
    return Path(path)


def write_version(
    engine,
    state_dict: dict,
    store: str,
    version: int,
    step: int,
    trainer_cfg,
    consumed: int,
    base_sha256: str = "",
    write_full=write_weights,
    model_dir=None,
    guard=None,
) -> dict:
    """Write ``state_dict`` (what ``engine.state_dict()`` returned) as version ``version``; returns
    the WeightUpdate record to publish once the trainer's own checkpoint is durable.
    ``write_full``: the full-weights writer (the trainer passes its module's, which benchmarks time);
    ``model_dir``: where config and tokenizer come from with ``publish_hf`` (default: the engine's);
    ``guard``: rides out storage faults (see the module doc)."""
    args = (engine, state_dict, store, version, step, trainer_cfg, consumed, base_sha256, write_full, model_dir)
    if guard is None:
        return _write_version(*args)

    def attempt() -> dict:  # what a failed try (or a crash) left whose cleanup failed too goes first
        remove_version(store, version)  # no notice names this version yet: nothing reads it
        return _write_version(*args)

    need = sum(t.numel() * t.element_size() for t in state_dict.values())
    return guard.call(
        attempt, f"writing weights v{version}", version_dir(store, version), need,
        lambda: remove_version(store, version),
    )  # fmt: skip


def _write_version(engine, state_dict, store, version, step, trainer_cfg, consumed, base_sha256, write_full, model_dir):
    update = {
        "version": version,
        "step": step,
        "created_at_ms": 0,
        "format": FORMAT,
        "trainer_id": trainer_cfg.trainer_id,
        "metadata": {"engine": trainer_cfg.engine.type},
        "kind": engine.weights_kind,
        "consumed_groups": int(consumed),
    }
    if engine.weights_kind == "adapter":
        conf = engine.adapter_config()
        uri, sha, nbytes = write_adapter(store, version, state_dict, conf)
        update.update(adapter_fields(conf["r"], conf["lora_alpha"], conf["target_modules"]), base_sha256=base_sha256)
    else:
        if trainer_cfg.publish_hf:  # before the weights: the weights complete the directory
            vdir = version_dir(store, version)
            write_hf_files(base_model_dir(engine, model_dir), vdir)
            update["metadata"][HF_DIR_KEY] = vdir
        uri, sha, nbytes = write_full(store, version, state_dict, shard_bytes=trainer_cfg.shard_bytes)
        update["format"] = weights_format(uri)
    update.update(uri=uri, sha256=sha, bytes=nbytes, created_at_ms=now_ms())
    return update


def start_signer(store: str, ptr: dict | None, guard=None) -> NoticeSigner | None:
    """This start's notice signer (``pipeline.notice_auth``): the job's key, created by a trainer
    that starts afresh, and a new writer epoch. A trainer resuming a checkpoint of an older rlstream
    (unsigned notices, no key in the store) keeps publishing unsigned notices, with a warning.
    ``guard``: writing the epoch rides out storage faults (a trainer restarted on a full disk waits
    there, saying so, instead of failing its start again and again)."""
    start = lambda: NoticeSigner.start(store, create=ptr is None)  # noqa: E731
    signer = start() if guard is None else guard.call(start, "writing the notice writer epoch", store)
    if signer is None and is_signed((ptr or {}).get("update") or {}):
        raise RlstreamError(
            f"this job signs its weight notices but its notice key {notice_key_uri(store)} is gone: restore it "
            "(readers refuse notices signed with another key), or start afresh"
        )
    if signer is None:
        log.warning("this job's notices stay unsigned: it was started by an older rlstream %s", kv(store=store))
    return signer
