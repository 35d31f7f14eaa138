"""Prompt datasets for the feed: JSON Lines, Parquet (needs pyarrow) and directories saved by HF
``datasets`` (``load_from_disk``, needs ``datasets``), normalized to one record shape.

A normalized record: ``prompt_id``, ``text``, ``task``, ``reference`` (a JSON string for the
verifier), ``n`` (group size or None for the config's), ``max_new_tokens`` (or None) and
``metadata`` (str -> str). Which source fields feed them is configured in ``FeedConfig``.
Errors name the file and the record. What this is not: a streaming reader; the whole dataset is
loaded (its size and hash are part of the feed's resume state).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.errors import ConfigError

RESERVED = {"n", "group_size", "max_new_tokens", "metadata"}


def read_raw(path: Path, fmt: str = "auto") -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"feed.source {path} does not exist")
    if fmt == "auto":
        fmt = "hf_disk" if path.is_dir() else "parquet" if path.suffix == ".parquet" else "jsonl"
    if fmt == "jsonl":
        text = path.read_text()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = []
            for i, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ConfigError(f"{path}:{i}: not valid JSON: {exc}") from exc
        return rows
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError("reading Parquet needs pyarrow (pip install pyarrow)") from exc
        return pq.read_table(path).to_pylist()
    if fmt == "hf_disk":
        try:
            from datasets import load_from_disk
        except ImportError as exc:
            raise ConfigError("reading a saved HF dataset needs `datasets` (pip install datasets)") from exc
        ds = load_from_disk(str(path))
        if hasattr(ds, "keys"):  # a DatasetDict: take the train split, else the first one
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        return [dict(r) for r in ds]
    raise ConfigError(f"unknown feed.format {fmt!r}")


def normalize(rows: list[dict], fc, where: str = "dataset") -> list[dict]:
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ConfigError(f"{where}: record {i} is not an object")
        text = r.get(fc.prompt_field, r.get("text"))
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{where}: record {i} has no prompt text (field {fc.prompt_field!r} or 'text')")
        pid = r.get(fc.id_field, r.get("prompt_id", i))
        task = r.get(fc.task_field) or fc.default_task
        used = {fc.id_field, "prompt_id", fc.prompt_field, "text", fc.task_field, *RESERVED}
        ref = r[fc.reference_field] if fc.reference_field in r else {k: v for k, v in r.items() if k not in used}
        n = r.get("n", r.get("group_size"))
        mnt = r.get("max_new_tokens")
        for name, v in (("n", n), ("max_new_tokens", mnt)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{where}: record {i}: {name} must be a positive integer, got {v!r}")
        meta = r.get("metadata") or {}
        if not isinstance(meta, dict):
            raise ConfigError(f"{where}: record {i}: metadata must be an object")
        out.append(
            {
                "prompt_id": str(pid),
                "text": text,
                "task": str(task),
                "reference": json.dumps(ref, sort_keys=True, default=str),
                "n": n,
                "max_new_tokens": mnt,
                "metadata": {str(k): str(v) for k, v in meta.items()},
            }
        )
    return out


def load_dataset(fc) -> list[dict]:
    if fc.source is None:
        raise ConfigError("feed.source is not set (give a file or directory)")
    return normalize(read_raw(fc.source, fc.format), fc, str(fc.source))


def dataset_hash(records: list[dict]) -> str:
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()
