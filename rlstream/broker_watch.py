"""Stops a local broker when the process that started it for itself dies (``LocalBroker.start``
with ``owned=True``): a bench, ``rlstream run``/``demo`` with no broker running, chaos, the test
fixture. Such a broker must not outlive its owner, even when the owner is killed with ``kill -9``
or aborts in native code (a librdkafka assertion once did, in chaos).

The JVM cannot watch its parent, and ``PR_SET_PDEATHSIG`` follows the *thread* that forked (chaos
restarts the broker from a thread, which then ends), so this small process watches both through
pidfds that the owner opens and passes down (no PID can be reused under it): when the owner exits
it sends the broker SIGTERM, then SIGKILL after ``grace_s``; when the broker exits first (a normal
stop), it exits too.

Run as ``python -m rlstream.broker_watch OWNER_FD BROKER_FD GRACE_S``. Not a supervisor: it never
restarts anything, and it imports nothing from the rest of rlstream.
"""

from __future__ import annotations

import select
import signal
import sys
import time


def _readable(fds: list[int], timeout: float) -> list[int]:
    return select.select(fds, [], [], timeout)[0]


def watch(owner_fd: int, broker_fd: int, grace_s: float) -> int:
    while True:  # wakes once a minute even if nothing happens; exits only on an exit it saw
        ready = _readable([owner_fd, broker_fd], 60.0)
        if broker_fd in ready:
            return 0  # stopped by its owner (or crashed): nothing to do
        if owner_fd in ready:
            break
    print("broker watch: the broker's owner is gone; stopping the broker", file=sys.stderr, flush=True)
    try:
        signal.pidfd_send_signal(broker_fd, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if _readable([broker_fd], 0.5):
                return 0
        print(f"broker watch: no exit {grace_s:.0f} s after SIGTERM; SIGKILL", file=sys.stderr, flush=True)
        signal.pidfd_send_signal(broker_fd, signal.SIGKILL)
    except ProcessLookupError:  # it exited between the checks
        pass
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the owner, which stops the broker
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
