"""The checkpoint store for published weights: safetensors files behind fsspec URIs.

``write_weights`` writes ``<store>/v<version>/model.safetensors`` completely (temp name, then
rename), and only then returns the URI and sha256 that a WeightUpdate may announce.
``read_weights`` fetches and verifies them. ``gc_versions`` keeps the newest few.

Trainer checkpoints (optimizer state, consumed offsets) are the trainer's own business; they may
reuse ``atomic_write_bytes``.
"""

from __future__ import annotations

import hashlib
import logging
import time

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
