"""The trainer's own checkpoint directory (``trainer.checkpoint_dir``, default ``<run_dir>/trainer``):

* ``ckpts/<tag>/``: engine state (model, optimizer, scheduler) of one checkpoint; a fresh tag per
  attempt, so a crash mid-write never mixes two checkpoints.
* ``steps.jsonl``: one line per finished trainer step (trajectory ids used, stale and dropped
  ids, loss, ...), appended and fsynced *before* the pointer below names the step.
* ``checkpoint.json``: the pointer, written atomically last. It names the tag and holds version,
  step, the offset state of rl.scored, the trained group ids, the WeightUpdate of that version,
  cumulative counters and ``files``: the sha256 of every file of the tag's directory. Under
  ``previous`` it holds the same record (offsets included) of each older checkpoint still kept
  (``trainer.keep_checkpoints``), oldest first. Only what it names exists; steps-log lines beyond
  its step belong to lost work and are cut on the next start.
* ``checkpoint.json.prev``: the pointer before the current one, copied atomically before each
  replace. A damaged pointer (not JSON, no tag) falls back to it with one loud warning, like a
  damaged checkpoint: its checkpoint and offsets are used and the steps after it trained again.

Start-up (``choose``) takes the newest checkpoint whose files all match their digests; a damaged
or missing one is skipped with one loud warning, and the next older one is used with its own
offsets (so what it had not consumed is consumed again, and trained once). None valid:
``CheckpointDamaged``, one line naming the file.

Writes go through ``guard`` (a ``pipeline.store_guard.StoreGuard``, set by the trainer): on a full
disk or a failing store each write removes what it half-wrote (a tag directory, the steps-log lines
it appended, a temp pointer), pauses with the fault said on screen, and is tried again; nothing is
committed until the pointer is written whole.

Not the published weights: those go to ``cfg.store`` via ``pipeline.checkpoint.write_weights``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from consumers.trainer.engines.base import broadcast_object
from pipeline.checkpoint import atomic_write_bytes
from pipeline.errors import CheckpointDamaged, RlstreamError
from pipeline.log import kv
from pipeline.pidlock import PidLock
from pipeline.store_guard import StoreGuard, tree_bytes

log = logging.getLogger(__name__)

POINTER = "checkpoint.json"
PREVIOUS_POINTER = "checkpoint.json.prev"
FELL_BACK = "fell_back_from_damaged_pointer"
"""Set in a pointer ``read_pointer`` returned from ``checkpoint.json.prev``: the newest version
this trainer announced is unknown (at least the pointer's)."""


def _parse_pointer(p: Path) -> dict:
    try:
        ptr = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # written atomically: not by a crash
        raise CheckpointDamaged(f"trainer checkpoint pointer {p} is not valid JSON ({exc})") from None
    if not isinstance(ptr, dict) or "tag" not in ptr:
        raise CheckpointDamaged(f"trainer checkpoint pointer {p} names no checkpoint (no tag)")
    return ptr


STEPS_LOG = "steps.jsonl"


class TrainerCheckpoints:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.ckpts = self.root / "ckpts"
        self._lock = PidLock(self.root / ".lock")
        self.guard = StoreGuard(None)
        """Runs the writes below through storage faults (the trainer sets one that says them on screen)."""

    def lock(self):
        """Hold an exclusive lock on the directory (``.lock``); RlstreamError if another trainer has it."""
        f = self.try_lock()
        if f is None:
            raise RlstreamError(f"another trainer is using {self.root} (its .lock is held)")
        return f

    def try_lock(self):
        """The lock's handle, or None while another trainer holds it (the OS frees it when that
        process dies, kill -9 included). The holder's PID is written into the file (``holder``)."""
        return self._lock.try_lock()

    def holder(self) -> int | None:
        """PID of the trainer that last took the lock, if that process is alive (None otherwise)."""
        return self._lock.holder()

    unlock = staticmethod(PidLock.unlock)

    def read_pointer(self) -> dict | None:
        """The pointer; if it is damaged, the previous one (``checkpoint.json.prev``) with one loud
        warning and ``FELL_BACK`` set in it (``CheckpointDamaged`` if that is missing or damaged too)."""
        p = self.root / POINTER
        if not p.is_file():
            return None
        try:
            return _parse_pointer(p)
        except CheckpointDamaged as exc:
            damaged = str(exc)
            prev = self.root / PREVIOUS_POINTER
            if not prev.is_file():
                raise
            try:
                ptr = _parse_pointer(prev)
            except CheckpointDamaged as older:
                raise CheckpointDamaged(f"{damaged}; the previous pointer too: {older}") from None
        log.warning(
            "TRAINER CHECKPOINT POINTER DAMAGED: %s; falling back to the previous pointer %s (step %d, version %d) "
            "and its consumed offsets: the steps after it are trained again",
            damaged,
            prev,
            ptr["step"],
            ptr["version"],
        )
        return {**ptr, FELL_BACK: True}

    @staticmethod
    def history(ptr: dict | None) -> list[dict]:
        """The checkpoint records a pointer holds, newest first (each without ``previous``)."""
        if not ptr:
            return []
        newest = {k: v for k, v in ptr.items() if k not in ("previous", FELL_BACK)}
        return [newest, *reversed(ptr.get("previous") or [])]

    def digests(self, tag: str) -> dict[str, str]:
        """sha256 of every file under the tag's directory, by path relative to it."""
        d = self.tag_dir(tag)
        out = {}
        for f in sorted(x for x in d.rglob("*") if x.is_file()):
            with open(f, "rb") as fh:
                out[f.relative_to(d).as_posix()] = hashlib.file_digest(fh, "sha256").hexdigest()
        return out

    def problem(self, entry: dict) -> str | None:
        """Why the checkpoint ``entry`` records cannot be used (naming the file), or None. A
        record without ``files`` (written before digests) is only checked for its directory."""
        d = self.tag_dir(entry["tag"])
        if not d.is_dir():
            return f"its directory {d} is missing"
        for name, want in sorted((entry.get("files") or {}).items()):
            f = d / name
            if not f.is_file():
                return f"{f} is missing"
            with open(f, "rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() != want:
                    return f"{f} does not match its sha256 {want[:12]}... ({f.stat().st_size} bytes)"
        return None

    def choose(self, ptr: dict | None, usable=None) -> tuple[dict | None, list[dict]]:
        """The newest valid checkpoint record of ``ptr`` and the older ones kept (oldest first).
        ``usable(entry)``: a further check (loading it); returns a problem string or None. A
        fallback logs one warning; none valid raises ``CheckpointDamaged`` naming the newest's
        problem."""
        entries = self.history(ptr)
        skipped: list[str] = []
        for i, entry in enumerate(entries):
            why = self.problem(entry) or (usable(entry) if usable else None)
            if why is None:
                if skipped:
                    log.warning(
                        "TRAINER CHECKPOINT DAMAGED: %s; falling back to checkpoint %s (step %d, version %d) "
                        "and its consumed offsets: the steps after it are trained again %s",
                        "; ".join(skipped),
                        entry["tag"],
                        entry["step"],
                        entry["version"],
                        kv(newest_step=entries[0]["step"], newest_version=entries[0]["version"]),
                    )
                return entry, list(reversed(entries[i + 1 :]))
            skipped.append(f"checkpoint {entry['tag']} (step {entry['step']}): {why}")
        if not entries:
            return None, []
        more = f" (and {len(skipped) - 1} older checkpoint(s) too)" if len(skipped) > 1 else ""
        raise CheckpointDamaged(
            f"no valid trainer checkpoint in {self.root}: {skipped[0]}{more}; restore the file, or start "
            f"afresh with a new trainer.checkpoint_dir and topics"
        )

    def write_pointer(self, state: dict) -> None:
        """Keep the current pointer as ``checkpoint.json.prev`` (if it is intact), then replace it;
        both writes atomic (through ``guard``)."""
        self.guard.call(lambda: self._write_pointer(state), "writing the trainer checkpoint pointer", str(self.root))

    def _write_pointer(self, state: dict) -> None:
        p = self.root / POINTER
        try:
            _parse_pointer(p)
            atomic_write_bytes(str(self.root / PREVIOUS_POINTER), p.read_bytes())
        except (FileNotFoundError, CheckpointDamaged):  # none yet, or damaged: the older copy stays
            pass
        state = {k: v for k, v in state.items() if k != FELL_BACK}
        atomic_write_bytes(str(p), json.dumps(state, sort_keys=True).encode())

    def new_tag(self, step: int) -> str:
        return f"step{step:08d}-{time.time_ns():x}"

    def tag_dir(self, tag: str) -> Path:
        return self.ckpts / tag

    def save_engine(self, engine, tag: str) -> None:
        """``engine.save`` into the tag's directory (through ``guard``: a failed try's directory is
        removed before the next). Nothing is removed before a try: the other ranks of a multi-rank
        trainer write their shards into the same directory at the same time."""
        d = self.tag_dir(tag)

        def need() -> int:  # about one checkpoint: the largest earlier one (after a failure only)
            if not self.ckpts.is_dir():
                return 0
            return max((tree_bytes(str(x)) for x in self.ckpts.iterdir() if x.name != tag), default=0)

        self.guard.call(
            lambda: engine.save(d), f"writing trainer checkpoint {tag}", str(self.root), need,
            lambda: shutil.rmtree(d, ignore_errors=True),
        )  # fmt: skip

    def append_steps(self, entries: list[dict]) -> None:
        """Append (and fsync) one line per step, through ``guard``: a failed try's lines are cut
        before the next, so no step is logged twice."""
        if not entries:
            return
        need = sum(len(json.dumps(e)) + 1 for e in entries)
        self.guard.call(lambda: self._append_steps(entries), "appending to the trainer steps log", str(self.root), need)

    def _append_steps(self, entries: list[dict]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / STEPS_LOG
        size = path.stat().st_size if path.is_file() else 0
        try:
            with open(path, "a") as f:
                for e in entries:
                    f.write(json.dumps(e, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with open(path, "r+b") as f:  # cut what this try appended: whole lines only, none twice
                f.truncate(size)
            raise

    def truncate_steps(self, max_step: int) -> int:
        """Keep only whole lines with ``step <= max_step``. Returns how many lines were cut."""
        path = self.root / STEPS_LOG
        if not path.is_file():
            return 0
        keep, cut = [], 0
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a crash mid-append
                cut += 1
                continue
            if entry["step"] <= max_step:
                keep.append(line)
            else:
                cut += 1
        if cut:
            data = "".join(x + "\n" for x in keep).encode()
            self.guard.call(lambda: atomic_write_bytes(str(path), data), "cutting the trainer steps log",
                            str(self.root), len(data))  # fmt: skip
        return cut

    def gc(self, keep: list[str]) -> list[str]:
        """Delete checkpoint dirs whose tag is not in ``keep``."""
        if not self.ckpts.is_dir():
            return []
        gone = []
        for d in self.ckpts.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
        return gone


def trainer_root(cfg) -> Path:
    """The trainer's checkpoint directory: ``trainer.checkpoint_dir``, else ``<run_dir>/trainer``."""
    return Path(cfg.trainer.checkpoint_dir or Path(cfg.run_dir) / "trainer")


def has_checkpoint(cfg) -> bool:
    """The job's trainer has written a checkpoint pointer (damaged or not): the job is not fresh."""
    return (trainer_root(cfg) / POINTER).exists()


def read_steps_log(root: Path) -> list[dict]:
    """The committed steps: lines of ``steps.jsonl`` up to the pointer's step."""
    ck = TrainerCheckpoints(root)
    ptr = ck.read_pointer()
    if ptr is None:
        return []
    out = []
    path = ck.root / STEPS_LOG
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry["step"] <= ptr["step"]:
            out.append(entry)
    return out


UNKNOWN_NEWEST = 2**62
"""``restore``'s newest version after a pointer fallback: versions this trainer announced past the
previous pointer's continue the numbering (the trainer announces a version only after its pointer)."""


def restore(ckpts: TrainerCheckpoints, engine, rank: int, world: int) -> tuple[dict | None, list[dict], int]:
    """Load the newest valid checkpoint into ``engine`` (``TrainerCheckpoints.choose``: digests
    checked on rank 0, the choice broadcast; a single process also falls back when loading fails).
    Returns its record, the older records kept, and the newest record's version."""
    ptr = ckpts.read_pointer() if rank == 0 else None
    newest = int(ptr["version"]) if ptr else 0
    if ptr and ptr.get(FELL_BACK):  # the damaged pointer's version is unknown: any this trainer announced
        newest = UNKNOWN_NEWEST

    def load(entry: dict) -> str | None:  # several ranks: loaded below, on every rank together
        try:
            if world == 1:
                engine.load(ckpts.tag_dir(entry["tag"]))
        except Exception as exc:  # a damaged file of a checkpoint written before digests
            return f"loading it failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        return None

    chosen = ckpts.choose(ptr, load) if rank == 0 else None
    chosen, newest = broadcast_object((chosen, newest) if rank == 0 else None, world)
    entry, older = chosen or (None, [])
    if entry is not None and world > 1:
        engine.load(ckpts.tag_dir(entry["tag"]))
    return entry, older, newest
