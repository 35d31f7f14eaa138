"""Who wrote a weight notice: the job's notice key, the trainer's writer epoch, sign and verify.

rl.control can be written by anyone who may produce to it; a WeightUpdate is trusted only if it
proves it was written by a process that holds the job's **notice key**: 32 random bytes created
once per job (``ensure_key``: by ``rlstream run``'s launcher before any role starts, else by the
trainer; ``pipeline.checkpoint.notice_key_uri``: ``<store>/notice/key``, beside the weights, so every reader of checkpoints can read it and a writer of rl.control alone
cannot) and reuses after a restart. The trainer signs each notice (``NoticeSigner.sign``): its
``metadata`` gets ``rlstream.epoch`` (the **writer epoch**, a counter the trainer bumps and
persists at each start, ``<store>/notice/epoch``) and ``rlstream.sig``, an HMAC-SHA256 under the
key over the canonical form of every field (``canonical``: version, uri, sha256, bytes, step,
created_at_ms, format, trainer_id, kind, the adapter fields, base_sha256, consumed_groups and the
metadata but the signature itself). No Avro schema change: ``metadata`` is a string map. The
trainer's progress Commands (``groups_consumed``: admission) and the feed's resume state
(``feed_state``, signed with writer epoch 0 by the feed once the job has a key)
carry the same two entries in their ``args`` (``command_canonical``: name, issuer, time and
arguments). A reader acts on no Command that fails these checks.

Readers (``NoticeVerifier``, used by ``pipeline.control.ControlFollower`` and the tools that list
versions) refuse, with a reason:

* ``unsigned_notice``: no signature, and the job has a key;
* ``bad_signature``: the signature does not match (a forged or altered notice);
* ``stale_writer_epoch``: signed by an older trainer after a newer epoch's notice was accepted (a
  zombie trainer that was replaced);
* ``unverifiable_signature``: signed, but the key cannot be read (the store is not reachable or
  not readable by this reader: tried ``KEY_TRIES`` times, ``KEY_RETRY_S`` (times the try) apart,
  the first time; later notices are checked without waiting).

A key that is there but cannot be read (not a missing one) is an error at a reader's start
(``NoticeVerifier.check``: one line, the role exits) and, later, a refusal of every notice,
unsigned ones included, until it can be read again.

Compatibility: while the store has no key (a job started by an older rlstream, whose trainer then
keeps publishing unsigned notices), unsigned notices are accepted with one warning per reader.
Once a key exists, unsigned notices are refused. What this is not: the plausibility of a notice's
version (``pipeline.control``) nor the verification of its checkpoint (``pipeline.checkpoint``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time

from pipeline.checkpoint import (
    atomic_write_bytes,
    create_exclusive,
    notice_epoch_uri,
    notice_key_uri,
    read_small,
)
from pipeline.errors import RlstreamError
from pipeline.log import kv

log = logging.getLogger(__name__)
SIG_KEY = "rlstream.sig"
"""WeightUpdate metadata key of the HMAC-SHA256 (hex) over ``canonical``."""
EPOCH_KEY = "rlstream.epoch"
"""WeightUpdate metadata key of the writer epoch (a decimal string)."""
KEY_BYTES = 32
KEY_TRIES = 3
KEY_RETRY_S = 1.0
"""Seconds between tries of reading the key for a signed notice (times the try number)."""
KEY_CHECK_S = 60.0
"""How long a reader's start retries a key that the store fails to return (``NoticeVerifier.check``)."""

_FIELDS = (
    ("version", int, 0),
    ("uri", str, ""),
    ("sha256", str, ""),
    ("bytes", int, 0),
    ("step", int, 0),
    ("created_at_ms", int, 0),
    ("format", str, "safetensors"),
    ("trainer_id", str, ""),
    ("kind", str, "full"),
    ("adapter_rank", int, 0),
    ("adapter_alpha", float, 0.0),
    ("adapter_target_modules", lambda xs: [str(x) for x in xs], []),
    ("base_sha256", str, ""),
    ("consumed_groups", int, -1),
)
"""The signed WeightUpdate fields with their types and the schema's defaults (a writer's values
are normalized as Avro returns them to a reader: an int alpha reads back as a float)."""


def canonical(rec: dict) -> bytes:
    """The bytes a notice's signature covers: every field, and the metadata but the signature."""
    body = {name: norm(rec.get(name, default)) for name, norm, default in _FIELDS}
    body["metadata"] = {str(k): str(v) for k, v in (rec.get("metadata") or {}).items() if k != SIG_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def command_canonical(rec: dict) -> bytes:
    """The bytes a Command's signature covers (the trainer's progress records): its name, issuer,
    time and every argument but the signature."""
    body = {
        "name": str(rec["name"]),
        "issued_by": str(rec.get("issued_by", "")),
        "created_at_ms": int(rec.get("created_at_ms", 0)),
        "args": {str(k): str(v) for k, v in (rec.get("args") or {}).items() if k != SIG_KEY},
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _is_command(rec: dict) -> bool:
    return "args" in rec and "name" in rec


def _attrs(rec: dict) -> dict:
    """Where a record carries its epoch and signature: a notice's ``metadata``, a Command's ``args``."""
    return (rec.get("args") if _is_command(rec) else rec.get("metadata")) or {}


def _what(rec: dict) -> str:
    """How a message names a record: ``notice v3``, ``command feed_state``."""
    return f"command {rec['name']}" if _is_command(rec) else f"notice v{rec['version']}"


def signature(key: bytes, rec: dict) -> str:
    body = command_canonical(rec) if _is_command(rec) else canonical(rec)
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sign(rec: dict, key: bytes, epoch: int) -> dict:
    """A copy of notice (or Command) ``rec`` signed with ``key`` as writer epoch ``epoch`` (an
    older signature and epoch are replaced)."""
    field = "args" if _is_command(rec) else "metadata"
    attrs = {k: v for k, v in _attrs(rec).items() if k != SIG_KEY}
    out = {**rec, field: {**attrs, EPOCH_KEY: str(int(epoch))}}
    out[field][SIG_KEY] = signature(key, out)
    return out


def is_signed(rec: dict) -> bool:
    return SIG_KEY in _attrs(rec)


def epoch_of(rec: dict) -> int | None:
    """The writer epoch a notice states (None: none, or not a number)."""
    try:
        return int(_attrs(rec)[EPOCH_KEY])
    except (KeyError, ValueError):
        return None


def load_key(store: str) -> bytes | None:
    """The job's notice key (None: the store has none). RlstreamError if it is damaged."""
    uri = notice_key_uri(store)
    key = read_small(uri)
    if key is not None and len(key) != KEY_BYTES:
        raise RlstreamError(f"notice key {uri} is damaged ({len(key)} bytes, not {KEY_BYTES})")
    return key


def ensure_key(store: str) -> bytes:
    """The job's notice key, created first if the store has none (once: of two racing creators
    one wins and both read its key). The trainer calls it at each start; ``rlstream run``'s
    launcher before any role starts, so no reader ever sees the job without a key (and accepts an
    unsigned notice while the trainer is still loading)."""
    key = load_key(store)
    if key is None:
        if create_exclusive(notice_key_uri(store), os.urandom(KEY_BYTES)):
            log.info("created notice key %s", kv(uri=notice_key_uri(store)))
        key = load_key(store)
    if key is None:
        raise RlstreamError(f"notice key {notice_key_uri(store)} was created but cannot be read back")
    return key


class NoticeSigner:
    """The trainer's side: the key and this start's writer epoch."""

    def __init__(self, key: bytes, epoch: int):
        self.key, self.epoch = key, epoch

    @classmethod
    def start(cls, store: str, create: bool = True) -> NoticeSigner | None:
        """Load the job's key (creating it if absent and ``create``), bump the writer epoch and
        persist it. None: no key and not ``create`` (an older job: its notices stay unsigned)."""
        key = ensure_key(store) if create else load_key(store)
        if key is None:
            return None
        raw = read_small(notice_epoch_uri(store))
        epoch = (int(raw) if raw and raw.strip() else 0) + 1
        atomic_write_bytes(notice_epoch_uri(store), f"{epoch}\n".encode())
        log.info("signing notices %s", kv(writer_epoch=epoch))
        return cls(key, epoch)

    def sign(self, rec: dict) -> dict:
        return sign(rec, self.key, self.epoch)


class NoticeVerifier:
    """A reader's side: ``problem(rec)`` is None for a notice it may accept, else ``(error_type,
    reason)``; ``note(rec)`` records an accepted notice's epoch (older epochs are refused after it)."""

    def __init__(self, store: str, tries: int = KEY_TRIES, retry_s: float = KEY_RETRY_S, warn: bool = True):
        """``warn``: say once, as a warning, that unsigned notices are accepted (a tool that lists
        versions says it on its debug log only: its terminal output is its answer)."""
        self.store, self.tries, self.retry_s, self.warn = store, tries, retry_s, warn
        self.key: bytes | None = None
        self.epoch = 0
        """The newest writer epoch accepted."""
        self._patient = True  # the first signed notice without a readable key waits for it
        self._warned = False
        self.unreadable: OSError | None = None
        """The last error reading a key that is there (an unsigned notice is then refused, not let through)."""

    def check(self, deadline_s: float = KEY_CHECK_S) -> None:
        """At a reader's start: RlstreamError (one line) if the job's key is there but cannot be read,
        or is damaged. Absent is fine (a job of an older rlstream, or the trainer creates it soon).
        A store that fails for a while (an I/O error, a timeout) is retried with backoff for
        ``deadline_s``; a permission or path error is refused at once."""
        uri = notice_key_uri(self.store)
        end, wait = time.monotonic() + deadline_s, 1.0
        while True:
            try:
                self.key = load_key(self.store)
                return
            except OSError as exc:
                mistake = isinstance(exc, PermissionError | IsADirectoryError | NotADirectoryError)
                if mistake or time.monotonic() + wait > end:
                    raise RlstreamError(
                        f"cannot read the notice key {uri} ({exc.__class__.__name__}: {exc}): weight notices "
                        "cannot be verified; make the checkpoint store readable to this role"
                    ) from exc
                log.warning("cannot read the notice key yet; retrying %s", kv(uri=uri, error=exc, in_s=wait))
                time.sleep(wait)
                wait = min(2 * wait, 10.0)

    def _load(self, patient: bool) -> bytes | None:
        tries = self.tries if patient and self._patient else 1
        for i in range(tries):
            if i:
                time.sleep(self.retry_s * i)
            try:
                self.key = load_key(self.store)
                self.unreadable = None
            except OSError as exc:  # unreachable or unreadable: every notice is refused below
                self.unreadable = exc
                log.warning("cannot read the notice key %s", kv(uri=notice_key_uri(self.store), error=exc))
            if self.key is not None:
                return self.key
        if patient:
            self._patient = False
        return None

    def problem(self, rec: dict, writer_epoch: bool = True) -> tuple[str, str] | None:
        """For a WeightUpdate, or a Command (checked without waiting for the key). ``writer_epoch``:
        refuse a record of an epoch older than one accepted (the trainer's records; a feed's state
        is signed with epoch 0 and not ordered against the trainer's)."""
        command = _is_command(rec)
        signed = is_signed(rec)
        key = self.key or self._load(patient=signed and not command)
        uri = notice_key_uri(self.store)
        if key is None:
            if signed:
                return "unverifiable_signature", f"{_what(rec)} is signed but the notice key {uri} cannot be read"
            if self.unreadable is not None:  # there may well be a key: an unsigned record is not let through
                return (
                    "unverifiable_signature",
                    f"{_what(rec)} carries no signature and the notice key {uri} cannot be read ({self.unreadable})",
                )
            if not self._warned:
                self._warned = True
                log.log(
                    logging.WARNING if self.warn else logging.DEBUG,
                    "no notice key: accepting unsigned notices (a job of an older rlstream) %s",
                    kv(uri=uri),
                )
            return None
        if not signed:
            return "unsigned_notice", f"{_what(rec)} carries no signature, and this job's notices are signed ({uri})"
        epoch = epoch_of(rec)
        if epoch is None or not hmac.compare_digest(_attrs(rec)[SIG_KEY], signature(key, rec)):
            return "bad_signature", f"{_what(rec)}: the signature does not match its fields under the key {uri}"
        if writer_epoch and epoch < self.epoch:
            return (
                "stale_writer_epoch",
                f"{_what(rec)} is of writer epoch {epoch}, older than epoch {self.epoch} already accepted "
                "(a trainer that was replaced)",
            )
        return None

    def note(self, rec: dict) -> None:
        epoch = epoch_of(rec) if self.key is not None else None
        if epoch is not None:
            self.epoch = max(self.epoch, epoch)


def verified(store: str, updates: list[dict]) -> list[dict]:
    """The notices of ``updates`` (in topic order) a reader accepts: signed by this job's key and not
    of a stale epoch, or unsigned while the store has no key. For tools that list versions."""
    verifier, out = NoticeVerifier(store, tries=1, warn=False), []
    for rec in updates:
        problem = verifier.problem(rec)
        if problem is None:
            verifier.note(rec)
            out.append(rec)
        else:
            log.warning("ignoring a weight notice %s", kv(version=rec["version"], error=problem[0]))
    return out
