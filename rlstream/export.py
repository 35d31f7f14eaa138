"""``rlstream export``: a published policy version as a Hugging Face model directory.

It takes the newest WeightUpdate on rl.control whose weights are still in the store (or
``--version N``; one that does not exist is refused in one line listing those there are; the
lookup is ``find_update``, which ``rlstream eval --version`` uses too), fetches and verifies its
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
from pipeline.errors import ConfigError, DecodeError, RlstreamError, UnknownVersion
from pipeline.kafka import Consumer, client_conf
from pipeline.log import kv
from pipeline.records import update_kind

log = logging.getLogger(__name__)


def published(cfg) -> dict[int, dict]:
    """Every WeightUpdate on the run's control topic, by version. ConfigError (one line) when the
    topic is not there: the command was not given the run's config."""
    from pipeline.admin import Admin

    topic = cfg.topics.name("control")
    admin = Admin(client_conf(cfg, "export"), cfg.kafka.request_timeout_s)
    try:
        there = topic in admin.list_topics()
    finally:
        admin.close()
    if not there:
        raise ConfigError(
            f"no topic {topic} on {cfg.kafka.bootstrap_servers}: give the run's config "
            f"(rlstream -c runs/<job>/config.toml ...) or its prefix (-s topics.prefix=<job>.)"
        )
    with Consumer(client_conf(cfg, "export", kind="consumer")) as c:
        msgs = c.read_to_end(topic, timeout=cfg.liveness.startup_timeout_s)
    updates: dict[int, dict] = {}
    for m in msgs:
        try:
            name, rec = codec.decode(m.value())
        except DecodeError:
            continue  # the control topic is rlstream's own; a stray record is not a version
        if name == "WeightUpdate":
            updates[rec["version"]] = rec
    return updates


def in_store(updates: dict[int, dict]) -> list[int]:
    """The versions whose weights are still in the store, newest first. The trainer deletes the
    oldest (``trainer.keep_weight_versions``), so the walk stops at the first one missing."""
    from pipeline.checkpoint import exists

    there = []
    for v in sorted(updates, reverse=True):
        if not exists(updates[v]["uri"]):
            break
        there.append(v)
    return there


def spans(versions: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``1-3, 5``."""
    out: list[str] = []
    for v in sorted(versions):
        if out and int(out[-1].rsplit("-", 1)[-1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def find_update(cfg, version: int | None, base: bool = False) -> dict | None:
    """The WeightUpdate of ``version`` (None: the newest whose weights are in the store). ``base``:
    version 0, the base model, may be asked for (returns None), and is the newest when nothing was
    published. UnknownVersion (one line, listing the versions there are) otherwise."""
    from pipeline.checkpoint import exists

    updates = published(cfg)
    if base and (version == 0 or (version is None and not updates)):
        return None
    if version in updates and exists(updates[version]["uri"]):
        return updates[version]
    there = in_store(updates)
    if version is None and there:
        return updates[there[0]]
    zero = "0 (the base model), " if base else ""
    if not updates:
        raise UnknownVersion(
            f"{cfg.topics.name('control')} announces no weights yet: the only version is 0, the base model (model.path)"
        )
    gone = sorted(set(updates) - set(there))
    asked = f"version {version} does not exist" if version is not None else "no published version is in the store"
    raise UnknownVersion(
        f"{asked}: the versions there are {zero}{spans(there) or 'none'}"
        + (f" (newest {there[0]})" if there else "")
        + (f"; {spans(gone)} were deleted from the store (trainer.keep_weight_versions)" if gone else "")
        + ("" if base else "; 0 is the base model (model.path)")
    )


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
