"""The checkpoint store for published weights: safetensors files behind fsspec URIs.

Full weights (``write_weights``) go to ``<store>/v<version>/`` in one of two layouts:

* ``model.safetensors``, one file (format ``safetensors``), when the state dict fits in one shard;
* Hugging Face's sharded layout (format ``safetensors-sharded``) when it is larger than
  ``shard_bytes``: ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``,
  whose ``weight_map`` says which shard holds each tensor and whose ``metadata`` also holds the
  manifest: every shard's sha256 and size (``rlstream.shards``). The shards are written in
  parallel threads (each streamed from the tensors' memory through sha256 to a temp file, then
  renamed); the index is written last, so a reader that sees the index sees every shard. The
  WeightUpdate names the index and carries *its* sha256, which covers the shards' hashes.

Either way the returned ``(uri, sha256, bytes)`` exist only once everything is written; a notice
announcing them is published after that (``pipeline.control``). Files carry ``{"format": "pt"}``
in their header and tensors in HF's names, so a version directory with the model's config and
tokenizer beside it (``write_hf_files``) is what ``from_pretrained`` and a stock vLLM server load.

Reading: ``iter_weights`` verifies the index against the notice's sha256, then reads the shards in
parallel threads, each into one buffer while hashing it, and yields ``(shard, tensors)`` as soon as
a shard is verified (tensors are zero-copy views of that buffer) while later shards are still being
read: that per-shard pipeline is what "streamed" means here. A reader never sees bytes that did
not match their sha256 (``ChecksumError`` names the shard). It does not start before the notice,
and so not before the last shard landed: the notice is the only signal that a version exists.
``read_weights`` collects everything into one state dict; single-file notices (format
``safetensors``, v1 and v2) read exactly as before.

LoRA adapters (``kind = "adapter"``): ``write_adapter`` writes ``<store>/v<version>/`` in PEFT's
layout, ``adapter_config.json`` first and ``adapter_model.safetensors`` last (the file the notice
names); the adapter config is also stored in the safetensors header, so the announced sha256
covers it. ``read_adapter`` verifies and returns both. ``model_fingerprint`` names a base model's
weights (the notice's ``base_sha256``). ``gc_versions`` keeps the newest few version directories
and those ``<store>/pins/`` names (``pipeline.best``: the best by held-out eval, the one being evaluated).

A write that fails (a full disk, a failing store) leaves no temp file behind; ``remove_version``
deletes a version directory whose write failed, so a retry starts clean (``pipeline.store_guard``
retries). ``faultfile://`` stores are local directories that slow down and fail on command
(``pipeline.faultfs``, for tests and fault runs).

Not here: trainer checkpoints (optimizer state, consumed offsets: the trainer's own business; they
may reuse ``atomic_write_bytes``), nor the decision of when an engine swaps weights in.
torch and safetensors are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import fsspec

from pipeline import faultfs, safetensors_io
from pipeline.errors import RlstreamError
from pipeline.log import kv
from pipeline.safetensors_io import CHUNK

log = logging.getLogger(__name__)
faultfs.register()  # ``faultfile://`` stores: a local disk that slows down and fails on command (tests, chaos)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FORMAT = "safetensors"
"""WeightUpdate format of a single ``model.safetensors`` (and of every adapter)."""
SHARDED_FORMAT = "safetensors-sharded"
"""WeightUpdate format of HF's sharded layout: the notice names ``model.safetensors.index.json``."""
MANIFEST_KEY = "rlstream.shards"
"""Key of the index's ``metadata`` holding ``{shard file: {"sha256", "bytes"}}``."""
HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files of a model directory, besides its weights, that ``write_hf_files`` copies."""


class ChecksumError(RlstreamError):
    """A checkpoint's bytes do not match the sha256 its WeightUpdate (or its index) announced."""


def _fs(uri: str):
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


def join(store: str, *parts: str) -> str:
    return "/".join([store.rstrip("/"), *parts])


def io_threads() -> int:
    """Default number of threads that read or write shards: the CPUs, 2 to 8 (sha256 is the cost)."""
    return min(8, max(2, os.cpu_count() or 2))


def atomic_write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` so that readers see either nothing or the whole file."""
    fs, path = _fs(uri)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{time.monotonic_ns()}"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)  # a rename on local disks; object stores make a whole object visible at once
    except BaseException:  # a full disk, a failing store: no half-written temp file stays behind
        with contextlib.suppress(Exception):
            if fs.exists(tmp):
                fs.rm(tmp)
        raise


def exists(uri: str) -> bool:
    """Whether the checkpoint file ``uri`` (one safetensors file or a sharded index) is in its store."""
    fs, path = _fs(uri)
    return fs.exists(path)


NOTICE_DIR = "notice"
"""``<store>/notice/``: the notice key and the writer epoch (not a version directory: gc keeps it)."""


def notice_key_uri(store: str) -> str:
    return join(store, NOTICE_DIR, "key")


def notice_epoch_uri(store: str) -> str:
    return join(store, NOTICE_DIR, "epoch")


def read_small(uri: str) -> bytes | None:
    """The bytes of small file ``uri``; None if it is not there."""
    fs, path = _fs(uri)
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def create_exclusive(uri: str, data: bytes) -> bool:
    """Create ``uri`` holding ``data`` unless it exists (False then). On a local disk the file is
    written whole to a temp file of mode 0600 (``O_EXCL``) and hard-linked into place, which fails
    if it exists: two writers never both create it, a crash never leaves half of it, and only the
    job's user reads it. Elsewhere (object stores have no exclusive create): written whole if
    absent (the trainer's checkpoint-dir lock keeps a second trainer out)."""
    fs, path = _fs(uri)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True
    if fs.exists(path):
        return False
    atomic_write_bytes(uri, data)
    return True


def version_dir(store: str, version: int) -> str:
    return join(store, f"v{version:08d}")


def remove_version(store: str, version: int) -> bool:
    """Delete ``<store>/v<version>/`` and everything in it (a version whose write failed and that
    no notice names). Returns whether there was one."""
    fs, path = _fs(version_dir(store, version))
    if not fs.exists(path):
        return False
    fs.rm(path, recursive=True)
    return True


def weights_format(uri: str) -> str:
    """The WeightUpdate format of the full-weights checkpoint ``uri`` names."""
    return SHARDED_FORMAT if uri.endswith(INDEX_FILE) else FORMAT


def _write_file(uri: str, tensors: list[tuple[str, object]], metadata: dict[str, str]) -> tuple[str, int]:
    """Write one safetensors file at ``uri`` (``pipeline.safetensors_io``); returns ``(sha256, bytes)``."""
    fs, path = _fs(uri)
    return safetensors_io.write_file(fs, path, tensors, metadata)


# ---- full weights ---------------------------------------------------------------------------------
def plan_shards(state_dict: dict, shard_bytes: int | None) -> list[list[str]]:
    """Tensor names per shard, in state-dict order: a shard is closed before it would exceed
    ``shard_bytes`` (a bigger tensor gets a shard of its own). None: one shard."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state_dict.items():
        n = t.numel() * t.element_size()
        if shard_bytes is not None and shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_weights(
    store: str, version: int, state_dict, shard_bytes: int | None = None, threads: int | None = None
) -> tuple[str, str, int]:
    """Write a weights version to ``<store>/v<version>/``; returns ``(uri, sha256, bytes)``:
    ``model.safetensors`` if the state dict fits in ``shard_bytes`` (None: always one file), else
    the sharded layout whose index ``uri`` names (``bytes`` counts the shards and the index)."""
    return write_weights_dir(version_dir(store, version), state_dict, shard_bytes, threads)


def write_weights_dir(
    dir_uri: str, state_dict, shard_bytes: int | None = None, threads: int | None = None
) -> tuple[str, str, int]:
    """``write_weights`` into any directory (``rlstream export`` writes an HF directory with it)."""
    t0 = time.monotonic()
    meta = {"format": "pt"}
    groups = plan_shards(state_dict, shard_bytes)
    if len(groups) == 1:
        uri = join(dir_uri, WEIGHTS_FILE)
        digest, nbytes = _write_file(uri, list(state_dict.items()), meta)
        log.info("wrote weights %s", kv(uri=uri, bytes=nbytes, ms=round((time.monotonic() - t0) * 1e3, 1)))
        return uri, digest, nbytes
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    with ThreadPoolExecutor(min(threads or io_threads(), len(groups)), thread_name_prefix="ckpt-write") as ex:
        futs = [
            ex.submit(_write_file, join(dir_uri, f), [(k, state_dict[k]) for k in g], meta)
            for f, g in zip(names, groups, strict=True)
        ]
        written = [fut.result() for fut in futs]  # the first failure raises (the others finish first)
    index = {
        "metadata": {
            "total_size": sum(t.numel() * t.element_size() for t in state_dict.values()),
            MANIFEST_KEY: {f: {"sha256": d, "bytes": n} for f, (d, n) in zip(names, written, strict=True)},
        },
        "weight_map": {k: f for f, g in zip(names, groups, strict=True) for k in g},
    }
    data = json.dumps(index, indent=1, sort_keys=True).encode()
    uri = join(dir_uri, INDEX_FILE)
    atomic_write_bytes(uri, data)  # last: a reader that sees the index sees every shard
    nbytes = len(data) + sum(n for _, n in written)
    log.info(
        "wrote sharded weights %s",
        kv(uri=uri, shards=len(names), bytes=nbytes, ms=round((time.monotonic() - t0) * 1e3, 1)),
    )
    return uri, hashlib.sha256(data).hexdigest(), nbytes


@dataclass(frozen=True)
class ShardRef:
    """One file of a checkpoint and what it must hash to."""

    name: str
    uri: str
    sha256: str | None
    bytes: int | None


def checkpoint_files(uri: str, sha256: str | None) -> list[ShardRef]:
    """The files of the checkpoint ``uri`` names, each with its expected sha256: the file itself,
    or, for an index (verified against ``sha256`` first), its shards."""
    if not uri.endswith(INDEX_FILE):
        return [ShardRef(uri.rsplit("/", 1)[-1], uri, sha256, None)]
    index = json.loads(_read_file_verified(uri, sha256))
    manifest = (index.get("metadata") or {}).get(MANIFEST_KEY)
    if not isinstance(manifest, dict) or not manifest:
        raise ChecksumError(f"index {uri} has no {MANIFEST_KEY} manifest: its shards cannot be verified")
    if set(index.get("weight_map", {}).values()) - manifest.keys():
        raise RlstreamError(f"index {uri}: weight_map names shards its manifest does not list")
    parent = uri.rsplit("/", 1)[0]
    refs = []
    for name, m in sorted(manifest.items()):
        if "/" in name or "\\" in name or name.startswith("."):
            raise RlstreamError(f"index {uri}: shard name {name!r} is not a plain file name")
        refs.append(ShardRef(name, join(parent, name), str(m["sha256"]), int(m["bytes"])))
    return refs


def _read_shard(ref: ShardRef, keep: bool):
    """Read ``ref`` while hashing it; ``ChecksumError`` unless it matches. Returns its bytes as a
    uint8 tensor (``keep``) or the number of bytes verified. A local file is memory-mapped
    privately (copy-on-write): hashing and the tensors read the page cache, shared by every process
    on the host, with no copy (published files are never modified in place, see the module doc);
    any other store is read into a buffer of this process."""
    import torch

    fs, path = _fs(ref.uri)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    size = fs.size(path)
    if ref.bytes is not None and size != ref.bytes:
        raise ChecksumError(f"shard {ref.name} ({ref.uri}) has {size} bytes; its index says {ref.bytes}")
    h = hashlib.sha256()
    if local and size:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m.madvise(mmap.MADV_WILLNEED)  # read ahead from the disk while the first pages are hashed
        with memoryview(m) as mv:
            for i in range(0, size, CHUNK):
                h.update(mv[i : i + CHUNK])  # releases the GIL: shards hash in parallel threads
        buf = torch.frombuffer(m, dtype=torch.uint8) if keep else None  # the tensor keeps the mapping alive
        if not keep:
            m.close()
    else:
        buf = torch.empty(size if keep else min(size, CHUNK), dtype=torch.uint8)
        mv, pos = memoryview(buf.numpy()), 0
        with fs.open(path, "rb") as f:
            while pos < size:
                at = pos if keep else 0
                got = f.readinto(mv[at : at + min(CHUNK, size - pos)])
                if not got:
                    raise ChecksumError(f"shard {ref.name} ({ref.uri}) ended after {pos} of {size} bytes")
                h.update(mv[at : at + got])
                pos += got
    if ref.sha256 and h.hexdigest() != ref.sha256:
        raise ChecksumError(f"shard {ref.name} ({ref.uri}) does not match its sha256 {ref.sha256}")
    return buf if keep else size


def _pipeline(refs: list[ShardRef], fn, threads: int | None, ahead: int | None) -> Iterator:
    """``fn(ref)`` for every ref in ``threads`` threads, at most ``ahead`` refs started and not yet
    consumed; yields ``(ref, result)`` in completion order. Closing it early cancels what is left."""
    n = min(threads or io_threads(), len(refs))
    ex = ThreadPoolExecutor(n, thread_name_prefix="ckpt-read")
    todo = iter(refs)
    pending = {ex.submit(fn, r): r for r in [next(todo) for _ in range(min(len(refs), ahead or n + 1))]}
    try:
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                ref = pending.pop(fut)
                result = fut.result()  # a bad shard raises here, naming itself
                nxt = next(todo, None)
                if nxt is not None:
                    pending[ex.submit(fn, nxt)] = nxt
                yield ref, result
    finally:
        for fut in pending:
            fut.cancel()
        ex.shutdown(wait=True)


def iter_weights(
    uri: str, sha256: str | None = None, threads: int | None = None, ahead: int | None = None
) -> Iterator[tuple[str, dict]]:
    """Yield ``(file name, tensors)`` for every file of the checkpoint ``uri`` names, each once it
    is read and verified, while ``threads`` threads read the next ones (at most ``ahead`` shards
    buffered ahead of the consumer, default threads + 1). Tensors are CPU views of a buffer that
    belongs to them alone. Shards are always checked against the index; the index (or the single
    file) against ``sha256`` if given."""
    refs = checkpoint_files(uri, sha256)
    for ref, buf in _pipeline(refs, lambda r: _read_shard(r, keep=True), threads, ahead):
        yield ref.name, safetensors_io.parse(buf, ref.uri)


def read_weights(uri: str, sha256: str | None = None, threads: int | None = None) -> dict:
    """Fetch, verify and deserialize a full-weights checkpoint (one file or sharded) into a CPU
    state dict."""
    out: dict = {}
    for _, tensors in iter_weights(uri, sha256, threads):
        out.update(tensors)
    return out


def verify_checkpoint(uri: str, sha256: str | None, threads: int | None = None) -> int:
    """Check every file of a checkpoint against its sha256 without keeping it; returns the bytes read."""
    refs = checkpoint_files(uri, sha256)
    return sum(n for _, n in _pipeline(refs, lambda r: _read_shard(r, keep=False), threads, None))


def _read_file_verified(uri: str, sha256: str | None) -> bytes:
    fs, path = _fs(uri)
    with fs.open(path, "rb") as f:
        data = f.read()
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise ChecksumError(f"checkpoint {uri} does not match sha256 {sha256}")
    return data


def read_bytes_verified(uri: str, sha256: str | None) -> bytes:
    """The bytes of the file ``uri`` names, verified against ``sha256``. For a sharded checkpoint's
    index, every shard is verified too (streamed, not kept): a caller that checks a notice's
    checkpoint this way checks all of it."""
    data = _read_file_verified(uri, sha256)
    if uri.endswith(INDEX_FILE):
        verify_checkpoint(uri, sha256)
    return data


# ---- Hugging Face model directories ----------------------------------------------------------
def write_hf_files(model_dir, dest_dir: str) -> list[str]:
    """Copy what a Hugging Face model directory holds besides its weights (``HF_FILES``: config,
    generation config, tokenizer files, chat template) from ``model_dir`` to ``dest_dir`` (an
    fsspec URI), each atomically. With the weights beside them, ``dest_dir`` is what
    ``from_pretrained`` and a stock vLLM server load. Returns the names copied."""
    src = Path(model_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json: not a Hugging Face model directory")
    copied = []
    for name in HF_FILES:
        if (src / name).is_file():
            atomic_write_bytes(join(dest_dir, name), (src / name).read_bytes())
            copied.append(name)
    return copied


# ---- LoRA adapters --------------------------------------------------------------------------------
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
    return parse_adapter(_read_file_verified(uri, sha256))


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


PINS_DIR = "pins"
"""``<store>/pins/``: JSON files, each naming a ``version`` that ``gc_versions`` keeps (``pipeline.best``)."""


def pinned_versions(store: str) -> set[int]:
    """The versions the files in ``<store>/pins/`` name (an unreadable file names none)."""
    fs, path = _fs(join(store, PINS_DIR))
    found: set[int] = set()
    for p in fs.ls(path, detail=False) if fs.exists(path) else []:
        if p.endswith(".json"):
            try:
                with fs.open(p, "rb") as f:
                    v = json.loads(f.read()).get("version")
            except (FileNotFoundError, ValueError, AttributeError):
                continue
            if isinstance(v, int):
                found.add(v)
    return found


def gc_versions(store: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` version directories (every file in them: shards,
    index, HF files), except the versions pinned in ``<store>/pins/`` (``pipeline.best``: the best
    one by held-out eval, the one being evaluated). Returns the deleted ones."""
    fs, path = _fs(store)
    if not fs.exists(path):
        return []
    dirs = sorted(p for p in fs.ls(path, detail=False) if p.rstrip("/").rsplit("/", 1)[-1].startswith("v"))
    kept = {version_dir("", v).rsplit("/", 1)[-1] for v in pinned_versions(store)}
    doomed = [d for d in (dirs[:-keep] if keep > 0 else dirs) if d.rstrip("/").rsplit("/", 1)[-1] not in kept]
    for d in doomed:
        fs.rm(d, recursive=True)
    return doomed
