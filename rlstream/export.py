"""``rlstream export``: a published policy version as a Hugging Face model directory.

It takes the newest WeightUpdate on rl.control (or ``--version N``), fetches and verifies its
checkpoint from the store (one file or every shard), and writes a directory with the model's
``config.json``, its tokenizer files (``pipeline.checkpoint.write_hf_files``, the writer the
trainer's ``publish_hf`` uses too) and the weights as ``model.safetensors``, or sharded above
``trainer.shard_bytes`` — what ``AutoModelForCausalLM.from_pretrained`` loads and what a stock vLLM
server serves (``--model DIR``, or ``collective_rpc reload_weights``).

What this is not: a trainer checkpoint (optimizer state stays in the trainer's checkpoint dir),
nor an adapter export (a LoRA version directory is PEFT's layout already).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline import codec
from pipeline.errors import DecodeError, RlstreamError
from pipeline.kafka import Consumer, client_conf
from pipeline.log import kv

log = logging.getLogger(__name__)


def find_update(cfg, version: int | None) -> dict:
    """The newest WeightUpdate on rl.control, or the one of ``version``."""
    with Consumer(client_conf(cfg, "export", kind="consumer")) as c:
        msgs = c.read_to_end(cfg.topics.name("control"), timeout=cfg.liveness.startup_timeout_s)
    updates = []
    for m in msgs:
        try:
            name, rec = codec.decode(m.value())
        except DecodeError:
            continue  # the control topic is rlstream's own; a stray record is not a version
        if name == "WeightUpdate":
            updates.append(rec)
    if version is None:
        if not updates:
            raise RlstreamError(f"{cfg.topics.name('control')} announces no weights yet (version 0 is the base model)")
        return max(updates, key=lambda u: u["version"])
    for u in updates:
        if u["version"] == version:
            return u
    known = sorted(u["version"] for u in updates)
    raise RlstreamError(f"version {version} was never announced; announced: {known[-10:]}")


def export(cfg, out: Path, version: int | None = None) -> dict:
    """Write version ``version`` (newest if None) as an HF model directory ``out``; returns its update."""
    from pipeline.checkpoint import read_weights, write_hf_files, write_weights_dir
    from pipeline.models import materialize

    update = find_update(cfg, version)
    if (update.get("kind") or "full") != "full":
        raise RlstreamError(
            f"version {update['version']} is a LoRA adapter ({update['uri']}): its directory is PEFT's layout already"
        )
    base = materialize(cfg.model)
    state = read_weights(update["uri"], update["sha256"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_hf_files(base, str(out))
    write_weights_dir(str(out), state, shard_bytes=cfg.trainer.shard_bytes)
    (out / "rlstream-version.txt").write_text(f"{update['version']}\n{update['sha256']}\n")
    log.info("exported %s", kv(version=update["version"], dir=out, tensors=len(state)))
    return update
