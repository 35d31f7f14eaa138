"""``rlstream export``: a published policy version as a Hugging Face model directory.

It takes the newest WeightUpdate on rl.control (or ``--version N``), fetches and verifies its
checkpoint from the store, and writes a directory with the model's ``config.json``, its tokenizer
files and the weights as ``model.safetensors`` — what ``AutoModelForCausalLM.from_pretrained``
loads and what a stock vLLM server serves (``--model DIR``, or ``collective_rpc reload_weights``).

What this is not: a trainer checkpoint (optimizer state stays in the trainer's checkpoint dir).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pipeline import codec
from pipeline.errors import DecodeError, RlstreamError
from pipeline.kafka import Consumer, client_conf
from pipeline.log import kv

log = logging.getLogger(__name__)
MODEL_FILES = ("config.json", "generation_config.json")
"""Files of the model directory that describe the model (weights come from the checkpoint)."""


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
    from safetensors.torch import save_file

    from pipeline.checkpoint import read_weights
    from pipeline.models import load_tokenizer, materialize

    update = find_update(cfg, version)
    base = materialize(cfg.model)
    state = read_weights(update["uri"], update["sha256"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    load_tokenizer(base).save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "rlstream-version.txt").write_text(f"{update['version']}\n{update['sha256']}\n")
    log.info("exported %s", kv(version=update["version"], dir=out, tensors=len(state)))
    return update
