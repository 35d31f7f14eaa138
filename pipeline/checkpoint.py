"""The checkpoint store for published weights: safetensors files behind fsspec URIs.

``write_weights`` writes ``<store>/v<version>/model.safetensors`` completely (temp name, then
rename), and only then returns the URI and sha256 that a WeightUpdate may announce.
``read_weights`` fetches and verifies them. ``gc_versions`` keeps the newest few.

LoRA adapters (``kind = "adapter"``): ``write_adapter`` writes ``<store>/v<version>/`` in PEFT's
layout, ``adapter_config.json`` first and ``adapter_model.safetensors`` last (the file the notice
names, so a reader that sees it sees the whole adapter); the adapter config is also stored in the
safetensors header, so the announced sha256 covers it. ``read_adapter`` verifies and returns both.
``model_fingerprint`` names a base model's weights (the notice's ``base_sha256``).

Trainer checkpoints (optimizer state, consumed offsets) are the trainer's own business; they may
reuse ``atomic_write_bytes``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import fsspec

from pipeline.errors import RlstreamError
from pipeline.log import kv

log = logging.getLogger(__name__)


class ChecksumError(RlstreamError):
    """A checkpoint's bytes do not match the sha256 its WeightUpdate announced."""


def _fs(uri: str):
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


def join(store: str, *parts: str) -> str:
    return "/".join([store.rstrip("/"), *parts])


def atomic_write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` so that readers see either nothing or the whole file."""
    fs, path = _fs(uri)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{time.monotonic_ns()}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)  # a rename on local disks; object stores make a whole object visible at once


def version_dir(store: str, version: int) -> str:
    return join(store, f"v{version:08d}")


def write_weights(store: str, version: int, state_dict) -> tuple[str, str, int]:
    """Write a weights version; returns ``(uri, sha256, bytes)``."""
    from safetensors.torch import save

    t0 = time.monotonic()
    data = save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()})
    digest = hashlib.sha256(data).hexdigest()
    uri = join(version_dir(store, version), "model.safetensors")
    atomic_write_bytes(uri, data)
    log.info(
        "wrote weights %s", kv(version=version, uri=uri, bytes=len(data), ms=round((time.monotonic() - t0) * 1e3, 1))
    )
    return uri, digest, len(data)


ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_META_KEY = "rlstream.adapter_config"


def write_adapter(store: str, version: int, state_dict, adapter_config: dict) -> tuple[str, str, int]:
    """Write a LoRA adapter version (PEFT layout); returns ``(uri of the safetensors file, sha256, bytes)``.

    ``adapter_config`` is PEFT's ``adapter_config.json`` content (``r``, ``lora_alpha``,
    ``target_modules``, ...); it is written beside the weights and inside their header."""
    from safetensors.torch import save

    t0 = time.monotonic()
    conf = json.dumps(adapter_config, sort_keys=True)
    data = save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, metadata={ADAPTER_META_KEY: conf})
    digest = hashlib.sha256(data).hexdigest()
    vdir = version_dir(store, version)
    atomic_write_bytes(join(vdir, ADAPTER_CONFIG), conf.encode())
    uri = join(vdir, ADAPTER_FILE)
    atomic_write_bytes(uri, data)  # last: the notice names this file
    log.info(
        "wrote adapter %s", kv(version=version, uri=uri, bytes=len(data), ms=round((time.monotonic() - t0) * 1e3, 1))
    )
    return uri, digest, len(data)


def parse_adapter(data: bytes) -> tuple[dict, dict]:
    """``(state_dict, adapter_config)`` of verified adapter bytes (the config from the header)."""
    from safetensors.torch import load

    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    if ADAPTER_META_KEY not in meta:
        raise RlstreamError(f"not an rlstream adapter file (no {ADAPTER_META_KEY} in its header)")
    return load(data), json.loads(meta[ADAPTER_META_KEY])


def read_adapter(uri: str, sha256: str | None = None) -> tuple[dict, dict]:
    """Fetch and verify an adapter file; returns ``(state_dict, adapter_config)``."""
    return parse_adapter(read_bytes_verified(uri, sha256))


_FINGERPRINTS: dict[tuple, str] = {}


def model_fingerprint(model_dir) -> str:
    """sha256 over the names and sha256s of a model directory's ``*.safetensors`` files, sorted
    by name: the same base weights give the same fingerprint in every process. Hashing reads
    every weight file once (~1-2 GB/s); the result is memoised per (path, sizes, mtimes)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _FINGERPRINTS:
        outer = hashlib.sha256()
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda fh=fh: fh.read(1 << 24), b""):
                    h.update(chunk)
            outer.update(f"{f.name}:{h.hexdigest()}\n".encode())
        _FINGERPRINTS[key] = outer.hexdigest()
    return _FINGERPRINTS[key]


def read_bytes_verified(uri: str, sha256: str | None) -> bytes:
    fs, path = _fs(uri)
    with fs.open(path, "rb") as f:
        data = f.read()
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise ChecksumError(f"checkpoint {uri} does not match sha256 {sha256}")
    return data


def read_weights(uri: str, sha256: str | None = None) -> dict:
    """Fetch, verify and deserialize a weights file into a CPU state dict."""
    from safetensors.torch import load

    return load(read_bytes_verified(uri, sha256))


def gc_versions(store: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` version directories. Returns the deleted ones."""
    fs, path = _fs(store)
    if not fs.exists(path):
        return []
    dirs = sorted(p for p in fs.ls(path, detail=False) if p.rstrip("/").rsplit("/", 1)[-1].startswith("v"))
    doomed = dirs[:-keep] if keep > 0 else dirs
    for d in doomed:
        fs.rm(d, recursive=True)
    return doomed
