"""``python -m rlstream``: the same as the ``rlstream`` command; the way the supervisor starts roles
(or ``rlstream.forkserver``, which calls ``main`` in a forked child).

A supervised role (``RLSTREAM_PARENT_PID``, see ``pipeline.worker.die_with_parent``) that gets
SIGTERM before its command has installed its own handling (its imports take seconds on a loaded
machine: a job's end or a supervisor's stop right after a restart) exits at once with 0 and one
line: nothing has started yet that needs stopping, and a stop asked for is not a crash. Python's
default would die of the signal (-15), which the supervisor counts as an unclean stop. The role's
own handlers replace this one as soon as it sets them."""

import os
import signal
import sys


def _stopped_while_starting(signum, _frame):
    sys.stderr.write(f"rlstream: {signal.Signals(signum).name} before the role had started: exiting\n")
    raise SystemExit(0)


def main() -> None:
    if os.environ.get("RLSTREAM_PARENT_PID"):
        signal.signal(signal.SIGTERM, _stopped_while_starting)
    from rlstream.cli import run_cli  # after the handler: these imports are the slow part

    run_cli()


if __name__ == "__main__":
    main()
