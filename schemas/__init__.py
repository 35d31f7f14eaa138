"""Avro schemas of rlstream's messages and their loader.

Each file is ``<Name>.v<N>.avsc``. The newest version of a name is the reader schema;
every version ever shipped stays here so old data can still be decoded. This module only
loads and parses schemas; encoding lives in ``pipeline.codec``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

SCHEMA_DIR = Path(__file__).resolve().parent
_FILE_RE = re.compile(r"^(?P<name>[A-Za-z]+)\.v(?P<version>\d+)\.avsc$")
# Records that others reference by name must be parsed first.
_DEPENDENCIES = {"ScoredTrajectory": ("Trajectory",)}


@dataclass(frozen=True)
class SchemaInfo:
    """A parsed schema with its identity."""

    name: str
    version: int
    parsed: dict
    fingerprint: bytes  # 8-byte CRC-64-AVRO of the parsing canonical form (little-endian)
    fast: dict
    """The same schema carrying fastavro's "already parsed" marker: the one to hand to fastavro's
    readers and writers, which otherwise parse an unmarked schema again on every call (about
    20 us a record). ``parsed`` stays unmarked for the canonical form and for tools."""

    @property
    def label(self) -> str:
        return f"{self.name}.v{self.version}"


def load_schema_file(path: Path, named: dict | None = None) -> SchemaInfo:
    """Parse one ``.avsc`` file; ``named`` holds records it may reference."""
    m = _FILE_RE.match(path.name)
    if not m:
        raise ValueError(f"schema file name must be <Name>.v<N>.avsc, got {path.name}")
    raw = json.loads(path.read_text())
    named = named or {}
    # expand=True inlines referenced records, so each schema is self-contained.
    parsed = fastavro.parse_schema(raw, named_schemas=dict(named), expand=True, _write_hint=False)
    fast = fastavro.parse_schema(raw, named_schemas=dict(named), expand=True)
    canonical = to_parsing_canonical_form(parsed)
    fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
    return SchemaInfo(m["name"], int(m["version"]), parsed, fp, fast)


@cache
def all_schemas() -> tuple[SchemaInfo, ...]:
    """Every shipped schema version, dependencies first."""
    files = sorted(SCHEMA_DIR.glob("*.avsc"))
    by_name: dict[str, list[Path]] = {}
    for f in files:
        m = _FILE_RE.match(f.name)
        if not m:
            raise ValueError(f"unexpected schema file {f.name}")
        by_name.setdefault(m["name"], []).append(f)
    order = sorted(by_name, key=lambda n: len(_DEPENDENCIES.get(n, ())))
    out: list[SchemaInfo] = []
    latest_named: dict = {}
    for name in order:
        deps = {}
        for dep in _DEPENDENCIES.get(name, ()):
            deps.update(latest_named[dep])
        for f in sorted(by_name[name], key=lambda p: int(_FILE_RE.match(p.name)["version"])):
            info = load_schema_file(f, deps)
            out.append(info)
            named = dict(deps)
            fastavro.parse_schema(json.loads(f.read_text()), named_schemas=named)
            latest_named[name] = named
    return tuple(out)


@cache
def latest(name: str) -> SchemaInfo:
    """The newest version of a record name (the reader schema)."""
    versions = [s for s in all_schemas() if s.name == name]
    if not versions:
        known = sorted({s.name for s in all_schemas()})
        raise KeyError(f"unknown schema {name!r}; known: {', '.join(known)}")
    return max(versions, key=lambda s: s.version)


@cache
def by_fingerprint() -> dict[bytes, SchemaInfo]:
    return {s.fingerprint: s for s in all_schemas()}
