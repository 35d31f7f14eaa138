"""``rlstream export``: a published policy version as a Hugging Face model directory.

It takes the newest WeightUpdate on rl.control whose weights are still in the store (or
``--version N``; one that does not exist is refused in one line listing those there are; the
lookup is ``pipeline.versions.find_update``, which ``rlstream eval --version`` uses too), fetches and verifies its
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

from pipeline.errors import ConfigError, RlstreamError
from pipeline.log import kv
from pipeline.records import update_kind
from pipeline.versions import find_update

log = logging.getLogger(__name__)


def export(cfg, out: Path, version: int | None = None) -> dict:
    """Write version ``version`` (newest if None) as an HF model directory ``out``; returns its update."""
    from pipeline.checkpoint import read_weights, write_hf_files, write_weights_dir
    from pipeline.models import materialize

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: give the directory to write")
    update = find_update(cfg, version)
    if update_kind(update) != "full":
        raise RlstreamError(
            f"version {update['version']} is a LoRA adapter ({update['uri']}): its directory is PEFT's layout already"
        )
    base = materialize(cfg.model)
    state = read_weights(update["uri"], update["sha256"])
    out.mkdir(parents=True, exist_ok=True)
    write_hf_files(base, str(out))
    write_weights_dir(str(out), state, shard_bytes=cfg.trainer.shard_bytes)
    (out / "rlstream-version.txt").write_text(f"{update['version']}\n{update['sha256']}\n")
    log.info("exported %s", kv(version=update["version"], dir=out, tensors=len(state)))
    return update
