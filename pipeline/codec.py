"""Avro codec for rlstream messages.

Wire format (docs/reference/wire-format.md): Avro single-object encoding. Every value is
``C3 01`` + the writer schema's 8-byte CRC-64-AVRO fingerprint + the Avro binary body.
The fingerprint names the writer schema among all shipped versions in ``schemas/``; the
reader decodes with the newest version of the same record name (Avro schema resolution),
so old data stays readable after a schema gains optional fields.

Embedded values: a ``ScoredTrajectory`` (v2) carries its trajectory as the original encoded
Trajectory value (``trajectory_value``), so a reward worker never re-encodes it; ``decode`` fills
``trajectory`` from those bytes, and readers see the same record whatever the writer's version.

This module also packs token ids (int32 LE), logprobs (float32 LE) and masks (uint8) into
bytes. It does no Kafka I/O.
"""

from __future__ import annotations

import io
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence

import fastavro

import schemas
from pipeline.errors import DecodeError, SerializationError

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
SCHEMA_HEADER = "rl.schema"  # Kafka header with the human-readable schema label.


def encode(name: str, record: dict, ctx=None) -> bytes:
    """Encode ``record`` with the newest schema of ``name``. ``ctx`` is for error messages."""
    info = schemas.latest(name)
    buf = io.BytesIO()
    buf.write(MAGIC)
    buf.write(info.fingerprint)
    try:
        fastavro.schemaless_writer(buf, info.fast, _with_bytes_defaults(info.parsed, record))
    except Exception as exc:  # fastavro raises ValueError/TypeError/KeyError/AttributeError
        where = f" for {ctx}" if ctx else ""
        raise SerializationError(f"cannot encode {info.label}{where}: {exc}") from exc
    return buf.getvalue()


def _with_bytes_defaults(schema: dict, record):
    """Fill missing ``bytes`` fields with their default. Avro writes a bytes default as a JSON string
    whose code points are the bytes; fastavro would pass that ``str`` through and fail."""
    if not isinstance(record, dict) or not isinstance(schema, dict) or schema.get("type") != "record":
        return record
    out = record
    for f in schema["fields"]:
        name, ftype = f["name"], f["type"]
        if name not in record:
            if ftype == "bytes" and isinstance(f.get("default"), str):
                out = dict(out) if out is record else out
                out[name] = f["default"].encode("latin-1")
        elif (rtype := _record_branch(ftype)) is not None and isinstance(record[name], dict):
            sub = _with_bytes_defaults(rtype, record[name])
            if sub is not record[name]:
                out = dict(out) if out is record else out
                out[name] = sub
    return out


def _record_branch(ftype):
    """The record schema of a field type: the type itself, or a union's record branch."""
    for t in ftype if isinstance(ftype, list) else [ftype]:
        if isinstance(t, dict) and t.get("type") == "record":
            return t
    return None


def schema_of(data: bytes) -> schemas.SchemaInfo:
    """The writer schema of an encoded value; DecodeError if the header is not ours."""
    if data is None:
        raise DecodeError("value is null (tombstone)")
    if len(data) < HEADER_LEN or data[:2] != MAGIC:
        raise DecodeError(f"not an rlstream Avro message (bad magic {bytes(data[:2])!r})")
    info = schemas.by_fingerprint().get(bytes(data[2:HEADER_LEN]))
    if info is None:
        raise DecodeError(f"unknown schema fingerprint {bytes(data[2:HEADER_LEN]).hex()}", error_type="schema")
    return info


def decode(data: bytes, expected: str | None = None) -> tuple[str, dict]:
    """Decode a value. Returns ``(record name, record)``.

    ``expected`` restricts the record name; another name raises DecodeError(error_type="schema").
    """
    writer = schema_of(data)
    if expected is not None and writer.name != expected:
        raise DecodeError(f"expected {expected}, got {writer.label}", error_type="schema")
    reader = schemas.latest(writer.name)
    body = io.BytesIO(data[HEADER_LEN:])
    try:
        rec = fastavro.schemaless_reader(body, writer.fast, reader.fast if reader is not writer else None)
    except Exception as exc:  # truncated or corrupt body
        raise DecodeError(f"corrupt {writer.label} body: {exc!r}") from exc
    if body.tell() != len(data) - HEADER_LEN:
        raise DecodeError(f"{writer.label} body has {len(data) - HEADER_LEN - body.tell()} trailing bytes")
    if isinstance(rec.get("trajectory_value"), str):  # a resolved bytes default comes back as its JSON string
        rec["trajectory_value"] = rec["trajectory_value"].encode("latin-1")
    if rec.get("trajectory_value") and rec.get("trajectory") is None:  # an embedded value (ScoredTrajectory.v2)
        rec["trajectory"] = decode_as(rec["trajectory_value"], "Trajectory")
    return writer.name, rec


def decode_as(data: bytes, expected: str) -> dict:
    return decode(data, expected)[1]


class AvroSerializer:
    """quixstreams-style serializer: ``serializer(value, ctx) -> bytes``."""

    def __init__(self, name: str):
        self.name = name
        schemas.latest(name)  # fail fast on an unknown name

    def __call__(self, value: dict, ctx=None) -> bytes:
        return encode(self.name, value, ctx)


class AvroDeserializer:
    """``deserializer(bytes, ctx) -> dict``; raises DecodeError."""

    def __init__(self, name: str | None = None):
        self.name = name

    def __call__(self, data: bytes, ctx=None) -> dict:
        return decode(data, self.name)[1]


# ---- packed numeric arrays --------------------------------------------------------------
_LITTLE = sys.byteorder == "little"


def _pack(code: str, values: Iterable) -> bytes:
    if hasattr(values, "tolist"):  # numpy / torch
        values = values.tolist()
    a = array(code, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpack(code: str, data: bytes) -> array:
    a = array(code)
    if len(data) % a.itemsize:
        raise DecodeError(f"packed {code!r} array has {len(data)} bytes, not a multiple of {a.itemsize}")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a


def pack_i32(values: Iterable[int]) -> bytes:
    return _pack("i", values)


def unpack_i32(data: bytes) -> array:
    return _unpack("i", data)


def pack_f32(values: Iterable[float]) -> bytes:
    return _pack("f", values)


def unpack_f32(data: bytes) -> array:
    return _unpack("f", data)


def pack_u8(values: Sequence[int]) -> bytes:
    return bytes(values)


def unpack_u8(data: bytes) -> list[int]:
    return list(data)


assert struct.calcsize("i") == 4 and struct.calcsize("f") == 4
