"""Trainer checkpoints verify themselves: the newest checkpoint's file truncated, deleted,
bit-flipped, or its whole directory gone, and the trainer starts from the previous valid checkpoint
with one loud warning, its offsets with it: every sample is trained in exactly one finished step, and
no version number is announced twice with other weights or skipped. None valid: one line naming the
file, and an exit code the supervisor does not restart (a ConfigError)."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest

from tests.conftest import rlstream_cmd
from tests.test_trainer import TINY, ScoredProducer, read_topic, scored

pytestmark = pytest.mark.kafka

G, N, STEPS = 1, 2, 4


def _setup(make_config):
    overrides = [
        *TINY,
        "rl.max_staleness=8",
        f"rl.group_size={N}",
        f"rl.groups_per_step={G}",
        "topics.scored.partitions=1",
        "trainer.poll_timeout_s=0.2",
        "trainer.keep_checkpoints=2",
        "trainer.publish_every=1",
    ]
    cfg = make_config(*overrides)
    sp = ScoredProducer(cfg)
    produced = set()
    for i in range(G * STEPS):
        recs = [scored(f"g{i}", j, N, 0, float(j % 2), seq=i) for j in range(N)]
        produced |= {r["trajectory"]["trajectory_id"] for r in recs}
        sp.send(recs)
    sp.close()
    return cfg, overrides, produced


def _train(cfg, steps: int) -> None:
    from consumers.trainer.worker import Trainer

    trainer = Trainer(cfg, max_steps=steps)
    try:
        assert trainer.run() == steps
    finally:
        trainer.close()


def _newest(root: Path) -> Path:
    return root / "ckpts" / json.loads((root / "checkpoint.json").read_text())["tag"]


def _check_pointer(root: Path) -> None:
    """The pointer holds the digest of every file of its checkpoint and the previous one's record."""
    ptr = json.loads((root / "checkpoint.json").read_text())
    assert [e["step"] for e in ptr["previous"]] == [ptr["step"] - 1]
    assert ptr["previous"][0]["offsets"] and (root / "ckpts" / ptr["previous"][0]["tag"]).is_dir()
    assert set(ptr["files"]) == {p.name for p in (root / "ckpts" / ptr["tag"]).iterdir()}


def _damage(tag_dir: Path, kind: str) -> str:
    f = tag_dir / "engine.pt"
    if kind == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "delete":
        f.unlink()
    elif kind == "bitflip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
    else:  # the whole checkpoint directory gone
        for p in tag_dir.iterdir():
            p.unlink()
        tag_dir.rmdir()
        return str(tag_dir)
    return str(f)


@pytest.mark.parametrize("kind", ["truncate", "delete", "bitflip", "dir_gone"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(make_config, caplog, kind):
    from consumers.trainer.state import read_steps_log

    cfg, _, produced = _setup(make_config)
    root = Path(cfg.run_dir) / "trainer"
    _train(cfg, 2)
    named = _damage(_newest(root), kind)

    with caplog.at_level(logging.WARNING):
        _train(cfg, STEPS)
    warned = [r.getMessage() for r in caplog.records if "CHECKPOINT DAMAGED" in r.getMessage()]
    assert len(warned) == 1 and named in warned[0] and "(step 1, version 1)" in warned[0], warned

    entries = read_steps_log(root)
    assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
    used = [i for e in entries for i in e["used"]]
    assert len(used) == len(set(used)) and set(used) == produced  # nothing lost, nothing twice
    # step 2 was trained again from step 1's state; versions announced 1, 2 before the damage go
    # on 3, 4, 5: none announced twice with other weights, none skipped
    notices = [r for name, r in read_topic(cfg, "control") if name == "WeightUpdate"]
    by_version: dict[int, set[str]] = {}
    for r in notices:
        by_version.setdefault(r["version"], set()).add(r["sha256"])
    assert sorted(by_version) == list(range(1, STEPS + 2))
    assert all(len(s) == 1 for s in by_version.values())
    assert [e["version"] for e in entries] == [0, 2, 3, 4]
    _check_pointer(root)


def test_no_valid_checkpoint_is_one_line_naming_the_file_and_no_restart_loop(make_config, cli_env):
    from consumers.trainer.worker import Trainer
    from pipeline.errors import ConfigError

    cfg, overrides, _ = _setup(make_config)
    root = Path(cfg.run_dir) / "trainer"
    _train(cfg, 2)
    ptr = json.loads((root / "checkpoint.json").read_text())
    named = _damage(root / "ckpts" / ptr["tag"], "truncate")
    _damage(root / "ckpts" / ptr["previous"][0]["tag"], "delete")

    trainer = Trainer(cfg, max_steps=STEPS)
    try:
        with pytest.raises(ConfigError, match="no valid trainer checkpoint") as err:
            trainer.setup()
    finally:
        trainer.close()
    assert named in str(err.value) and "\n" not in str(err.value)

    args = [*rlstream_cmd(), "train", "--engine", "torch"] + [x for o in overrides for x in ("--set", o)]
    proc = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=120)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert proc.returncode != 0 and len(errors) == 1 and "no valid trainer checkpoint" in errors[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
