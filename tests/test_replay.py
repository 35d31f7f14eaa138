"""`rlstream replay`: a fresh trainer on an existing rl.scored log makes the same steps as the
original run (same samples per step, same staleness decisions, same losses), with its own topics
and checkpoint directory; the source log is only read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.test_trainer import TINY, ScoredProducer, scored

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_replay_reproduces_the_steps_of_the_original_run(make_config, cli_env, topic_prefix, tmp_path):
    from consumers.trainer.state import read_steps_log
    from consumers.trainer.worker import Trainer

    common = [*TINY, "rl.group_size=2", "rl.groups_per_step=2", "rl.max_staleness=1", "trainer.lr=0.01"]
    cfg = make_config(*common)
    sp = ScoredProducer(cfg)
    for g in range(8):  # group 5's samples are too old for the step that takes them: dropped as stale
        sp.send([scored(f"g{g}", i, 2, 0 if g == 5 else g // 2, float(i), seq=g) for i in range(2)])
    sp.close()
    assert Trainer(cfg, max_steps=4).run() == 4
    original = read_steps_log(Path(cfg.run_dir) / "trainer")

    out = run_cli(["replay", topic_prefix, *(x for s in common for x in ("--set", s))], cli_env, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["groups"] == 8 and result["prefix"] != topic_prefix
    [replay_dir] = Path(cli_env["RLSTREAM_RUN_DIR"]).glob("replay-*")
    replayed = read_steps_log(replay_dir / "trainer")
    assert [s["used"] for s in replayed] == [s["used"] for s in original]
    assert [s["stale"] for s in replayed] == [s["stale"] for s in original] and any(s["stale"] for s in original)
    assert [s["loss"] for s in replayed] == pytest.approx([s["loss"] for s in original], rel=1e-5, abs=1e-7)
