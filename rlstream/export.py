"""``rlstream export``: a published policy version as a Hugging Face model directory.

It takes the newest WeightUpdate on rl.control whose weights are still in the store (or
``--version N``; one that does not exist is refused in one line listing those there are; the
lookup is ``pipeline.versions.find_update``, which ``rlstream eval --version`` uses too), fetches and verifies its
checkpoint from the store (one file or every shard), and writes a directory with the model's
``config.json``, its tokenizer files (``pipeline.checkpoint.write_hf_files``, the writer the
trainer's ``publish_hf`` uses too) and the weights as ``model.safetensors``, or sharded above
``trainer.shard_bytes`` — what ``AutoModelForCausalLM.from_pretrained`` loads and what a stock vLLM
server serves (``--model DIR``, or ``collective_rpc reload_weights``).

At the end of a job run that finished ok (``job.export``, on by default), ``export_run`` writes the
final version to ``<run dir>/export/final`` and the best one by held-out eval (``eval.best_metric``,
recorded by the eval role in the store: ``pipeline.best``) to ``<run dir>/export/best``.

What this is not: a trainer checkpoint (optimizer state stays in the trainer's checkpoint dir),
nor an adapter export (a LoRA version directory is PEFT's layout already; at the end of a job run
``export_run`` copies it as it is).
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
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: give the directory to write")
    update = find_update(cfg, version)
    if update_kind(update) != "full":
        raise RlstreamError(
            f"version {update['version']} is a LoRA adapter ({update['uri']}): its directory is PEFT's layout already"
        )
    write_hf_dir(cfg, update, out)
    return update


def write_hf_dir(cfg, update: dict, out: Path) -> None:
    """The full-weights version ``update`` announces, fetched and verified, as an HF directory ``out``."""
    from pipeline.checkpoint import read_weights, write_hf_files, write_weights_dir
    from pipeline.models import materialize

    base = materialize(cfg.model)
    state = read_weights(update["uri"], update["sha256"])
    out.mkdir(parents=True, exist_ok=True)
    write_hf_files(base, str(out))
    write_weights_dir(str(out), state, shard_bytes=cfg.trainer.shard_bytes)
    (out / "rlstream-version.txt").write_text(f"{update['version']}\n{update['sha256']}\n")
    log.info("exported %s", kv(version=update["version"], dir=out, tensors=len(state)))


def copy_adapter_dir(update: dict, out: Path) -> None:
    """A LoRA version's directory (PEFT's layout: ``adapter_config.json``, ``adapter_model.safetensors``),
    its weights verified against the notice, copied to ``out``; PEFT loads it onto ``model.path``."""
    from pipeline.checkpoint import ADAPTER_CONFIG, join, read_bytes_verified, read_small

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_model.safetensors").write_bytes(read_bytes_verified(update["uri"], update["sha256"]))
    conf = read_small(join(update["uri"].rsplit("/", 1)[0], ADAPTER_CONFIG))
    if conf is None:
        raise RlstreamError(f"version {update['version']}: {ADAPTER_CONFIG} is missing beside {update['uri']}")
    (out / ADAPTER_CONFIG).write_bytes(conf)
    (out / "rlstream-version.txt").write_text(f"{update['version']}\n{update['sha256']}\n")


# ---- the end of a job run ---------------------------------------------------------------------------
def export_run(cfg, run_dir: Path, say) -> dict:
    """After a job run finished ok (``job.export``): the final version to ``<run dir>/export/final`` and
    the best one by held-out eval (``pipeline.best``) to ``<run dir>/export/best``, each written to a
    temp directory first and then put in place of the previous export. ``say`` gets one line per
    directory (and one before each export starts); an earlier export this run does not replace is
    removed. Returns ``{"final": ..., "best": ...}`` for the
    report: ``{version, dir}`` (best also ``metric``, ``score``), with ``dir`` null and a ``note``
    when there is nothing to export. A failed export raises."""
    from pipeline.best import read_best
    from pipeline.errors import UnknownVersion

    root = Path(run_dir) / "export"
    out: dict = {}
    try:
        final = find_update(cfg, None)
    except UnknownVersion as exc:
        final = None
        out["final"] = {"version": None, "dir": None, "note": str(exc)}
        _drop(root / "final")
        say(f"export final: nothing to export: {exc}")
    if final is not None:
        out["final"] = {"version": final["version"], **_put(cfg, final, root / "final", "final", say)}

    best = read_best(cfg.store) if cfg.job.eval and cfg.eval.best_metric else None
    if best is None:
        why = (
            "no held-out eval: job.eval = false" if not cfg.job.eval
            else 'no best version kept: eval.best_metric = ""' if not cfg.eval.best_metric
            else "no version was evaluated"
        )  # fmt: skip
        out["best"] = {"version": None, "dir": None, "note": why}
        _drop(root / "best")
        say(f"export best: none ({why})")
        return out
    head = {"version": best["version"], "metric": best["metric"], "score": best["score"]}
    what = f"version {best['version']} ({best['metric']} {best['score']:.3f})"
    note = None
    if best["version"] == 0:
        note = "the base model (model.path) scored best: nothing to export"
    elif final is not None and best["version"] == final["version"] and out["final"]["dir"]:
        dest = _replace(root / "best", lambda tmp: _link_tree(root / "final", tmp))
        out["best"] = {**head, "dir": str(dest), "same_as": "final"}
        say(f"export best: {what} -> {dest} (the final version: files linked, not copied)")
        return out
    else:
        try:
            update = find_update(cfg, best["version"])
        except UnknownVersion as exc:
            update, note = None, f"its weights are not in the store: {exc}"
        if update is not None and best.get("sha256") and update["sha256"] != best["sha256"]:
            update, note = (
                None,
                f"the record in {cfg.store}/pins/best.json does not match version {best['version']}'s notice",
            )
        if update is not None:
            out["best"] = {
                **head,
                **_put(cfg, update, root / "best", "best", say, f" ({best['metric']} {best['score']:.3f})"),
            }
            return out
    out["best"] = {**head, "dir": None, "note": note}
    _drop(root / "best")
    say(f"export best: {what}: {note}")
    return out


def _put(cfg, update: dict, dest: Path, name: str, say, about: str = "") -> dict:
    """Export ``update`` to ``dest`` (replacing it); one line before and one after."""
    import time

    t0 = time.monotonic()
    v = update["version"]
    if update_kind(update) != "full":
        dest = _replace(dest, lambda tmp: copy_adapter_dir(update, tmp))
        say(
            f"export {name}: version {v}{about} is a LoRA adapter: its PEFT directory -> {dest} (load it on model.path)"
        )
        return {"dir": str(dest), "kind": "adapter"}
    say(f"exporting {name} version {v} to {dest} ...")
    dest = _replace(dest, lambda tmp: write_hf_dir(cfg, update, tmp))
    mb = sum(f.stat().st_size for f in dest.iterdir() if f.is_file()) / 1e6
    say(f"export {name}: version {v}{about} -> {dest} ({mb:.1f} MB, {time.monotonic() - t0:.1f} s)")
    return {"dir": str(dest)}


def _replace(dest: Path, write) -> Path:
    """``write(tmp)`` into a temp directory beside ``dest``, then put it in ``dest``'s place: an
    interrupted export leaves the previous one whole (and a temp directory, removed next time)."""
    import shutil
    import time

    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.parent / f".{dest.name}.tmp-{time.monotonic_ns()}"
    try:
        write(tmp)
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{time.monotonic_ns()}"
            dest.rename(old)
            shutil.rmtree(old)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _drop(dest: Path) -> None:
    """Remove an earlier run's export that this run does not replace (it is not this run's version)."""
    import shutil

    if dest.is_dir():
        shutil.rmtree(dest)


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` with the files of ``src``, hard-linked where the file system allows (else copied)."""
    import os
    import shutil

    dst.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)
