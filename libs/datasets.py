"""Prompt datasets for the feed: JSON Lines, Parquet (needs pyarrow) and directories saved by HF
``datasets`` (``load_from_disk``, needs ``datasets``), normalized to one record shape.

A record carries either plain prompt text or chat ``messages`` (OpenAI format: a list of
``{"role", "content"}``), which the rollout worker renders with the tokenizer's chat template.
A normalized record: ``prompt_id``, ``text``, ``messages`` (JSON, only when given), ``task``, ``reference`` (a JSON string for the
verifier), ``n`` (group size or None for the config's), ``max_new_tokens`` (or None) and
``metadata`` (str -> str). Which source fields feed them is configured in ``FeedConfig``.
Errors name the file and the record. What this is not: a streaming reader; the whole dataset is
loaded (its size and hash are part of the feed's resume state).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pipeline.config import StrictModel
from pipeline.errors import ConfigError

RESERVED = {"n", "group_size", "max_new_tokens", "metadata"}
ROLES = {"system", "user", "assistant", "tool"}


class DatasetFields(StrictModel):
    """Where a prompt dataset is and which of its record fields feed a prompt; the feed's section
    (``FeedConfig``) and the evaluator's held-out set (``eval.source``) read datasets the same way."""

    source: Path | None = None
    """Dataset: a .jsonl/.json file, a .parquet file, or a directory saved by HF ``datasets``."""
    format: Literal["auto", "jsonl", "parquet", "hf_disk"] = "auto"
    """How to read ``source``; ``auto`` picks by suffix (a directory is ``hf_disk``)."""
    id_field: str = "id"
    """Record field with the prompt id (falls back to ``prompt_id``, then to the record's index)."""
    prompt_field: str = "prompt"
    """Record field with the prompt text (falls back to ``text``)."""
    messages_field: str = "messages"
    """Record field with chat messages (OpenAI format); such a record needs no prompt text."""
    task_field: str = "task"
    """Record field with the task name (falls back to ``default_task``)."""
    reference_field: str = "reference"
    """Record field with the verifier data; if absent, every field except id/prompt/task/n is used."""
    default_task: str = "default"
    """Task of records that name none."""


def _messages(value, where: str) -> str:
    """Chat messages as canonical JSON; ConfigError naming the record if they are malformed."""
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value)
    )
    if not ok:
        raise ConfigError(
            f"{where}: messages must be a non-empty list of {{role, content}} with role in {sorted(ROLES)}"
        )
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in value])


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
        messages = _messages(r[fc.messages_field], f"{where}: record {i}") if fc.messages_field in r else None
        if messages is None and (not isinstance(text, str) or not text):
            raise ConfigError(
                f"{where}: record {i} has no prompt text (field {fc.prompt_field!r} or 'text') and no {fc.messages_field!r}"
            )
        pid = r.get(fc.id_field, r.get("prompt_id", i))
        task = r.get(fc.task_field) or fc.default_task
        used = {fc.id_field, "prompt_id", fc.prompt_field, "text", fc.task_field, fc.messages_field, *RESERVED}
        ref = r[fc.reference_field] if fc.reference_field in r else {k: v for k, v in r.items() if k not in used}
        n = r.get("n", r.get("group_size"))
        mnt = r.get("max_new_tokens")
        for name, v in (("n", n), ("max_new_tokens", mnt)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{where}: record {i}: {name} must be a positive integer, got {v!r}")
        meta = r.get("metadata") or {}
        if not isinstance(meta, dict):
            raise ConfigError(f"{where}: record {i}: metadata must be an object")
        rec = {
            "prompt_id": str(pid),
            "text": text if isinstance(text, str) else "",
            "task": str(task),
            "reference": json.dumps(ref, sort_keys=True, default=str),
            "n": n,
            "max_new_tokens": mnt,
            "metadata": {str(k): str(v) for k, v in meta.items()},
        }
        if messages is not None:  # only then: a plain dataset keeps its hash (and its feed's resume state)
            rec["messages"] = messages
        out.append(rec)
    return out


def load_dataset(fc) -> list[dict]:
    if fc.source is None:
        raise ConfigError("feed.source is not set (give a file or directory)")
    return normalize(read_raw(fc.source, fc.format), fc, str(fc.source))


def dataset_hash(records: list[dict]) -> str:
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()
