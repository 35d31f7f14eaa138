"""A local-disk store that slows down and fails on command: the ``faultfile://`` fsspec protocol.

A store URI ``faultfile:///abs/dir`` is the local directory ``/abs/dir`` through a filesystem that,
before each operation (open, rename, remove, list, stat, mkdir), reads its orders from the JSON file
that ``$FAULTFILE_ORDERS`` names (no variable, or no file: no fault) and

* sleeps ``delay_s`` seconds (a slow store),
* stalls until the file is changed or removed when ``stall`` is true (a store that hangs; a role's
  watchdog bounds it), and
* raises ``OSError(EIO)`` when ``fail`` is true (a store that fails; ``TimeoutError`` with
  ``"fail": "timeout"``),

for operations whose path is under ``path`` if the orders name one (else every path), on
operations whose name is in ``ops`` if given (``open``, ``mv``, ``rm``, ``ls``, ``info``, ``mkdir``).
Every role of a job sees the same orders, at once: ``rlstream chaos`` (``rlstream.dev.chaos_storage``)
and the tests write the file, the roles only read it (a few microseconds per operation: the file's
mtime is checked, its content re-read only when it changed).

Not a storage product: a fault injector for tests and fault runs. Being not the ``file`` protocol, a
store behind it is read the way object stores are (no memory-mapping), which those paths test too.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faultfile"
ENV = "FAULTFILE_ORDERS"
"""Environment variable naming the JSON file of orders (not ``RLSTREAM_*``: those are config
settings, which the launcher hands its roles in their config file, not in their environment)."""
OPS = ("open", "mv", "rm", "ls", "info", "mkdir")


class _Orders:
    """The orders file, re-read when its mtime changes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._orders: dict = {}

    def get(self) -> dict:
        path = os.environ.get(ENV)
        if not path:
            return {}
        try:
            st = os.stat(path)
        except OSError:
            return {}
        key = (path, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key != self._key:
                try:
                    with open(path) as f:
                        orders = json.load(f)
                except (OSError, ValueError):  # being rewritten: keep the last orders
                    return self._orders
                self._key, self._orders = key, orders if isinstance(orders, dict) else {}
            return self._orders


ORDERS = _Orders()


def write_orders(path, orders: dict | None) -> None:
    """Write (None: remove) the orders file at ``path`` atomically (the controller's side)."""
    if orders is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    with open(tmp, "w") as f:
        json.dump(orders, f)
    os.replace(tmp, path)


def _apply(op: str, path: str) -> None:
    o = ORDERS.get()
    if not o:
        return
    if o.get("ops") and op not in o["ops"]:
        return
    under = o.get("path")
    if under and not str(path).startswith(str(under).rstrip("/")):
        return
    if o.get("delay_s"):
        time.sleep(float(o["delay_s"]))
    if o.get("stall"):
        first = ORDERS.get()
        while ORDERS.get() is first and first.get("stall"):
            time.sleep(0.2)
    if o.get("fail"):
        if o["fail"] == "timeout":
            raise TimeoutError(errno.ETIMEDOUT, f"store timed out ({op} {path}, injected)")
        raise OSError(errno.EIO, f"store I/O error ({op} {path}, injected)")


class FaultFileSystem(LocalFileSystem):
    """``LocalFileSystem`` behind the orders of ``$FAULTFILE_ORDERS`` (see the module doc)."""

    protocol = (PROTOCOL,)
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _open(self, path, mode="rb", **kwargs):
        _apply("open", path)
        return super()._open(path, mode=mode, **kwargs)

    def mv(self, path1, path2, *args, **kwargs):
        _apply("mv", path1)
        return super().mv(path1, path2, *args, **kwargs)

    def rm(self, path, *args, **kwargs):
        _apply("rm", path if isinstance(path, str) else str(path[0]) if path else "")
        return super().rm(path, *args, **kwargs)

    def ls(self, path, detail=False, **kwargs):
        _apply("ls", path)
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        _apply("info", path)
        return super().info(path, **kwargs)

    def makedirs(self, path, exist_ok=False):
        _apply("mkdir", path)
        return super().makedirs(path, exist_ok=exist_ok)


def register() -> None:
    """Make ``faultfile://`` known to fsspec in this process (idempotent)."""
    fsspec.register_implementation(PROTOCOL, FaultFileSystem, clobber=True)
