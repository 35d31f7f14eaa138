"""Measure a rebalance pause: ``rlstream run`` with the reward worker ``reward-1`` started late,
once the trainer has reached step ``REWARD1_AFTER_STEP`` (default 10), as happens on a loaded
machine when its process is slow to start. The run's report then gives each stage's longest pause
after the first step (``longest_pause_s``; docs/results/performance.md, "Rebalance pauses").

    REWARD1_AFTER_STEP=10 RLSTREAM_HOME=/tmp/h python scripts/late_reward_worker.py \\
        run examples/next-digit.toml --no-live -s broker.port=0 -s run_dir=/tmp/runs

A measurement tool, not part of the package: it wraps two ``Launcher`` methods of this process only.
"""

from __future__ import annotations

import os
import sys
import time

from rlstream import launcher as L

AFTER_STEP = int(os.environ.get("REWARD1_AFTER_STEP", "10"))
_run = L.Launcher.run


def start_roles(self, sup, config_path):
    self._held = [r for r in self.roles if r.name == "reward-1"]
    for r in self.roles:
        if r not in self._held:
            self.start_role(sup, r, config_path)


def run(self, tick=None):
    def late_tick():
        step = self.progress.steps[-1]["step"] if self.progress.steps else 0
        if self._held and step >= AFTER_STEP:
            r = self._held.pop()
            self.start_role(self.sup, r, self.config_path)
            print(f"{time.strftime('%H:%M:%S')} started {r.name} at step {step}", file=sys.stderr)
        return tick() if tick else None

    return _run(self, late_tick)


if __name__ == "__main__":
    L.Launcher.start_roles, L.Launcher.run = start_roles, run
    from rlstream.cli import run_cli

    sys.argv = ["rlstream", *sys.argv[1:]]
    run_cli()
