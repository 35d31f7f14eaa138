"""A file lock that names its holder: an exclusive, non-blocking ``flock`` on one file, which the OS
frees when the holding process dies (kill -9 included), with the holder's PID written into the file
so that others can ask who holds it without touching the lock.

Used for one process per trainer checkpoint dir (``consumers.trainer.state``; its hot standby waits
on it) and for the rollout workers' static-membership slots (``producers.slots``; a warm spare
waits on them). Not the job's lease (``rlstream.lease``), which also spans hosts through Kafka.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class PidLock:
    def __init__(self, path: Path):
        self.path = Path(path)

    def try_lock(self):
        """The lock's open handle (held until ``unlock`` or the process ends), or None while another
        process holds it. The holder's PID is written into the file (``holder``)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        return f

    def holder(self) -> int | None:
        """PID of the process that last took the lock, if that process is alive (None otherwise).
        Read without touching the lock, so asking never makes a starting process fail."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        if not text.isdigit():
            return None
        try:
            os.kill(int(text), 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            pass
        return int(text)

    @staticmethod
    def unlock(handle) -> None:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
