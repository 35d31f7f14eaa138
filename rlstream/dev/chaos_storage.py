"""Storage faults for ``rlstream chaos``: a full disk under the weights store, a slow and failing
store, published weights that vanish after their notice.

Kinds (``StorageFaults.kinds``), planned from a size's ``storage_faults`` count (0 by default),
spread over the chaos phase, never two at once:

* ``disk_full``: the weights store (``cfg.store``, a local directory) is a small tmpfs that this
  class mounts when it plans the run (before any role writes to it; its size: the model's weights
  times ``trainer.keep_weight_versions + 3``, at least 64 MB). The fault fills it with one file
  until less than a third of the newest version's size is left, for ``arg`` seconds, then deletes
  the file. The trainer is to say ``disk full at ...; paused`` and resume by itself
  (``pipeline.store_guard``). Mounting needs root: without it the kind is not planned (said once).
* ``store_slow``: the store is ``faultfile://`` (``SETTINGS``: the run's config must name it; else
  the kind is skipped, said) and its orders (``pipeline.faultfs``: ``$FAULTFILE_ORDERS``, set here
  in this process's environment, which the roles inherit) make every operation under it take
  ``DELAY_S`` for the first half of ``arg`` seconds and fail with EIO for the second half. The
  trainer is to say ``weights store slow: ...``/``weights store failing at ...; retrying``.
* ``weights_vanish``: the newest version directory is deleted at once (its notice is out). Rollout
  workers are to say ``weights vN unavailable`` and go on with the next version.

Each fault done is recorded in ``done`` (``{"kind", "target", "t", "seconds", "seen"}``): ``seen``
holds what the roles said about it (the launcher's ``progress.fault_log`` lines that began while it
lasted; for ``weights_vanish`` the lines of the roles' logs that name the version).

Not the harness (``rlstream.dev.chaos``, which runs the class: ``plan``, ``do``, ``poll``, ``close``),
and not a way to test the roles' code paths one by one (``tests/test_storage_faults.py`` does).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from pipeline import faultfs
from pipeline.store_guard import MB, local_dir, tree_bytes
from rlstream.dev.chaos_plan import Fault

log = logging.getLogger(__name__)

KINDS = ("disk_full", "store_slow", "weights_vanish")
DELAY_S = 2.0
"""Seconds every store operation takes during a ``store_slow`` fault's slow half."""
FILLER = ".chaos-filler"
"""The file that fills the store's tmpfs (not a version directory: the trainer's gc leaves it)."""


def settings(run_dir: Path) -> dict:
    """Config settings a fault run with ``store_slow`` faults needs: its store behind ``faultfile://``,
    at the same local directory as the default store (so ``disk_full`` can mount there too)."""
    return {"checkpoint_store": f"{faultfs.PROTOCOL}://{Path(run_dir).resolve() / 'checkpoints'}"}


def _store_dir(store: str) -> Path | None:
    prefix = f"{faultfs.PROTOCOL}://"
    path = store[len(prefix) :] if store.startswith(prefix) else local_dir(store)
    return Path(path) if path else None


class StorageFaults:
    kinds: tuple[str, ...] = KINDS

    def __init__(self, ctx):
        self.ctx = ctx
        self.store = ctx.cfg.store
        self.dir = _store_dir(self.store)
        self.orders = Path(ctx.run_dir) / "faultfile-orders.json"
        self.mounted = False
        self.active: list[dict] = []
        """Faults in force: {fault, kind, end, wall_start, version}."""
        self.done: list[dict] = []
        self._vanished: list[dict] = []
        """``weights_vanish`` records whose ``seen`` is read from the logs at ``close``."""

    # -- planning --------------------------------------------------------------------------------
    def plan(self, p: dict, rng, duration_s: float) -> list[Fault]:
        n = int(p.get("storage_faults", 0))
        if n <= 0:
            return []
        kinds = [KINDS[i % len(KINDS)] for i in range(n)]
        rng.shuffle(kinds)
        if "disk_full" in kinds and not self._mount():
            kinds = [k if k != "disk_full" else "weights_vanish" for k in kinds]
        if "store_slow" in kinds and not self.store.startswith(f"{faultfs.PROTOCOL}://"):
            self.ctx.say(f"store_slow faults need the store behind {faultfs.PROTOCOL}:// (chaos_storage.settings); "
                         "planning weights_vanish instead")  # fmt: skip
            kinds = [k if k != "store_slow" else "weights_vanish" for k in kinds]
        if "store_slow" in kinds:
            os.environ[faultfs.ENV] = str(self.orders)  # the roles inherit it (started after this)
        seg = 0.8 * duration_s / n  # one per segment, in its first half: never two at once
        faults = []
        for i, kind in enumerate(kinds):
            at = 0.1 * duration_s + i * seg + rng.uniform(0, 0.3) * seg
            seconds = 0.0 if kind == "weights_vanish" else min(0.5 * seg, rng.uniform(15, 40))
            faults.append(Fault(at, kind, "store", arg=round(seconds, 1)))
        return faults

    def _mount(self) -> bool:
        """Mount a tmpfs over the store's directory (empty: before any role wrote to it)."""
        if self.dir is None:
            self.ctx.say(f"disk_full faults need a local store ({self.store}); planning weights_vanish instead")
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        if any(self.dir.iterdir()):
            self.ctx.say(f"disk_full faults need an empty store dir to mount a tmpfs on ({self.dir}); skipping them")
            return False
        size_mb = max(64, self._model_mb() * (self.ctx.cfg.trainer.keep_weight_versions + 3))
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(self.dir)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            self.ctx.say(f"cannot mount a tmpfs on {self.dir} ({why}); planning weights_vanish instead of disk_full")
            return False
        self.mounted = True
        self.ctx.say(f"weights store {self.dir} is a {size_mb} MB tmpfs (disk_full faults fill it)")
        return True

    def _model_mb(self) -> int:
        try:
            from pipeline.models import materialize

            d = Path(materialize(self.ctx.cfg.model))
            return 1 + sum(f.stat().st_size for f in d.glob("*.safetensors")) // MB
        except Exception as exc:  # sized generously instead
            log.warning("cannot size the model's weights (%s): sized for 128 MB of weights", exc)
            return 128

    # -- running ---------------------------------------------------------------------------------
    def _versions(self) -> list[Path]:
        if self.dir is None or not self.dir.is_dir():
            return []
        return sorted(d for d in self.dir.iterdir() if d.is_dir() and d.name.startswith("v") and d.name[1:].isdigit())

    @property
    def busy(self) -> bool:
        return bool(self.active)

    def do(self, f: Fault, t: float) -> str | None:
        if self.busy:
            return None
        versions = self._versions()
        if f.kind == "disk_full":
            if not self.mounted:
                return "skipped: the store is not on a tmpfs of ours"
            if not versions:
                return None  # nothing published yet: the size to leave is not known
            newest = tree_bytes(str(versions[-1]))
            n = shutil.disk_usage(self.dir).free - newest // 3
            if n <= 0:
                return None
            with open(self.dir / FILLER, "wb") as fh:
                os.posix_fallocate(fh.fileno(), 0, n)
            left = shutil.disk_usage(self.dir).free
            self._start(f, t, f.arg)
            return f"disk full at {self.dir} for {f.arg:.0f} s ({left / MB:.1f} MB left, a version is {newest / MB:.1f} MB)"
        if f.kind == "store_slow":
            faultfs.write_orders(self.orders, {"delay_s": DELAY_S, "path": str(self.dir)})
            self._start(f, t, f.arg, phase="slow")
            return f"weights store slow ({DELAY_S:g} s an operation) then failing, {f.arg:.0f} s"
        if f.kind == "weights_vanish":
            if len(versions) < 2:
                return None  # the first version: wait for a later one, so a newer one can supersede it
            shutil.rmtree(versions[-1], ignore_errors=True)
            v = int(versions[-1].name[1:])
            rec = {"kind": f.kind, "target": f"v{v}", "t": round(t, 1), "seconds": 0.0, "seen": [], "version": v}
            self.done.append(rec)
            self._vanished.append(rec)
            return f"deleted weights v{v} ({versions[-1]}) after its notice"
        return f"skipped: unknown storage fault {f.kind!r}"

    def _start(self, f: Fault, t: float, seconds: float, phase: str = "") -> None:
        self.active.append({"fault": f, "t": t, "end": t + seconds, "wall": time.time(), "phase": phase})

    def poll(self, t: float) -> None:
        for a in list(self.active):
            if a["phase"] == "slow" and t >= a["t"] + (a["end"] - a["t"]) / 2:
                faultfs.write_orders(self.orders, {"fail": True, "path": str(self.dir)})
                a["phase"] = "failing"
            if t >= a["end"]:
                self._end(a, t)

    def _end(self, a: dict, t: float) -> None:
        f = a["fault"]
        if f.kind == "disk_full":
            (self.dir / FILLER).unlink(missing_ok=True)
        else:
            faultfs.write_orders(self.orders, None)
        self.active.remove(a)
        seen = [
            f"{e['worker']}: {e['text']}"
            for e in getattr(getattr(self.ctx.launcher, "progress", None), "fault_log", [])
            if e["start"] >= a["wall"] - 2
        ]
        self.done.append({"kind": f.kind, "target": f.target, "t": round(a["t"], 1),
                          "seconds": round(t - a["t"], 1), "seen": seen})  # fmt: skip
        self.ctx.say(f"{f.kind} over after {t - a['t']:.0f} s; the roles said: {'; '.join(seen) or 'nothing'}")

    def close(self) -> None:
        """End every fault now, read what the roles said about vanished weights, unmount the tmpfs."""
        for a in list(self.active):
            self._end(a, a["end"])
        faultfs.write_orders(self.orders, None)
        logs = Path(self.ctx.run_dir) / "logs"
        for rec in self._vanished:
            needle = f"weights v{rec['version']} "
            for p in sorted(logs.glob("*.log")) if logs.is_dir() else []:
                with open(p, errors="replace") as fh:
                    rec["seen"] += [f"{p.stem}: {line.strip()[:200]}" for line in fh if needle in line][:3]
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.dir)], capture_output=True, check=False)
            self.mounted = False
