"""The safetensors format, written and parsed here, zero-copy both ways: a writer that streams each
tensor's bytes into the file and its sha256 without another copy, aligned so that readers can view
tensors in place, and a parser that returns views of one buffer. torch is imported inside
functions only. The checkpoint store (``pipeline.checkpoint``) is its one user."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time

from pipeline.errors import RlstreamError

CHUNK = 16 << 20
"""Bytes hashed and written (or read) per call: large enough to be fast, small enough to stream."""


@functools.cache
def _dtypes() -> dict:
    import torch

    names = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    }  # fmt: skip
    return names


def _raw(t) -> memoryview:
    """The bytes of tensor ``t`` (moved to the CPU, made contiguous), without another copy."""
    import torch

    t = t.detach().cpu().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _header(tensors: list[tuple[str, object]], metadata: dict[str, str]) -> tuple[bytes, list]:
    """The safetensors header of ``tensors`` and their order in the file: larger elements first,
    so every tensor's offset is a multiple of its element size (readers view them in place)."""
    codes = {v: k for k, v in _dtypes().items()}
    order = sorted(tensors, key=lambda kv_: (-kv_[1].element_size(), kv_[0]))
    head: dict = {"__metadata__": metadata}
    off = 0
    for name, t in order:
        if t.dtype not in codes:
            raise RlstreamError(f"tensor {name}: dtype {t.dtype} has no safetensors code")
        n = t.numel() * t.element_size()
        head[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    js = json.dumps(head, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return len(js).to_bytes(8, "little") + js, order


def write_file(fs, path: str, tensors: list[tuple[str, object]], metadata: dict[str, str]) -> tuple[str, int]:
    """Write one safetensors file at ``path`` of the fsspec filesystem ``fs`` (temp name, then
    rename); returns ``(sha256, bytes)``."""
    head, order = _header(tensors, metadata)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{path}.tmp-{time.monotonic_ns()}-{os.getpid()}"
    h, n = hashlib.sha256(head), len(head)
    try:
        with fs.open(tmp, "wb") as f:
            f.write(head)
            for _, t in order:
                mv = _raw(t)
                for i in range(0, len(mv), CHUNK):
                    h.update(mv[i : i + CHUNK])  # hashlib and file writes release the GIL
                    f.write(mv[i : i + CHUNK])
                n += len(mv)
        fs.mv(tmp, path)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
    return h.hexdigest(), n


def parse(buf, where: str) -> dict:
    """Tensors of the safetensors bytes in the uint8 tensor ``buf``: views of it, not copies."""
    dtypes = _dtypes()
    size = buf.numel()
    if size < 8:
        raise RlstreamError(f"{where}: not a safetensors file ({size} bytes)")
    n = int.from_bytes(bytes(buf[:8].numpy()), "little")
    if 8 + n > size:
        raise RlstreamError(f"{where}: safetensors header of {n} bytes does not fit in {size}")
    head = json.loads(bytes(buf[8 : 8 + n].numpy()))
    head.pop("__metadata__", None)
    out = {}
    for name, e in head.items():
        if e["dtype"] not in dtypes:
            raise RlstreamError(f"{where}: tensor {name} has unknown dtype {e['dtype']}")
        dt, (b, end), shape = dtypes[e["dtype"]], e["data_offsets"], e["shape"]
        numel = 1
        for d in shape:
            numel *= d
        raw = buf[8 + n + b : 8 + n + end]
        if raw.numel() != end - b or end - b != numel * dt.itemsize:
            raise RlstreamError(f"{where}: tensor {name} {shape} {e['dtype']} does not fit its offsets {b}..{end}")
        if (8 + n + b) % dt.itemsize:
            raw = raw.clone()  # a foreign writer's unaligned tensor: copy it rather than view it
        out[name] = raw.view(dt).view(shape)
    return out
