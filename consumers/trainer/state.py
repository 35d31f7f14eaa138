"""The trainer's own checkpoint directory (``trainer.checkpoint_dir``, default ``<run_dir>/trainer``):

* ``ckpts/<tag>/``: engine state (model, optimizer, scheduler) of one checkpoint; a fresh tag per
  attempt, so a crash mid-write never mixes two checkpoints.
* ``steps.jsonl``: one line per finished trainer step (trajectory ids used, stale and dropped
  ids, loss, ...), appended and fsynced *before* the pointer below names the step.
* ``checkpoint.json``: the pointer, written atomically last. It names the tag and holds version,
  step, the offset state of rl.scored, the trained group ids, the WeightUpdate of that version
  and cumulative counters. Only what it names exists; steps-log lines beyond its step belong to
  lost work and are cut on the next start.

Not the published weights: those go to ``cfg.store`` via ``pipeline.checkpoint.write_weights``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from pipeline.checkpoint import atomic_write_bytes
from pipeline.errors import RlstreamError

POINTER = "checkpoint.json"
STEPS_LOG = "steps.jsonl"


class TrainerCheckpoints:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.ckpts = self.root / "ckpts"

    def lock(self):
        """Hold an exclusive lock on the directory (``.lock``); RlstreamError if another trainer has it."""
        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / ".lock", "a+")  # held until unlock()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise RlstreamError(f"another trainer is using {self.root} (its .lock is held)") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        return f

    @staticmethod
    def unlock(handle) -> None:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def read_pointer(self) -> dict | None:
        p = self.root / POINTER
        if not p.is_file():
            return None
        return json.loads(p.read_text())

    def write_pointer(self, state: dict) -> None:
        atomic_write_bytes(str(self.root / POINTER), json.dumps(state, sort_keys=True).encode())

    def new_tag(self, step: int) -> str:
        return f"step{step:08d}-{time.time_ns():x}"

    def tag_dir(self, tag: str) -> Path:
        return self.ckpts / tag

    def append_steps(self, entries: list[dict]) -> None:
        if not entries:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / STEPS_LOG, "a") as f:
            for e in entries:
                f.write(json.dumps(e, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

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
            atomic_write_bytes(str(path), "".join(x + "\n" for x in keep).encode())
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
