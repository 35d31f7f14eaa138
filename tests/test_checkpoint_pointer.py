"""The trainer's pointer (``checkpoint.json``) keeps its previous copy (``checkpoint.json.prev``,
written atomically before each replace). A damaged pointer falls back to it with one loud warning,
like a damaged checkpoint: the previous checkpoint and its offsets are used, every sample is trained
in exactly one finished step, and the version numbering neither repeats nor skips."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.test_trainer import read_topic
from tests.test_trainer_checkpoint_damage import STEPS, _check_pointer, _setup, _train

pytestmark = pytest.mark.kafka


@pytest.mark.parametrize("damage", ["truncate", "no_tag"])
def test_a_damaged_pointer_falls_back_to_the_previous_one(make_config, caplog, damage):
    from consumers.trainer.state import read_steps_log

    cfg, _, produced = _setup(make_config)
    root = Path(cfg.run_dir) / "trainer"
    _train(cfg, 2)
    pointer, prev = root / "checkpoint.json", root / "checkpoint.json.prev"
    assert json.loads(prev.read_text())["step"] == 1 and json.loads(pointer.read_text())["step"] == 2
    if damage == "truncate":
        pointer.write_bytes(pointer.read_bytes()[: pointer.stat().st_size // 2])
    else:
        pointer.write_text(json.dumps({"step": 2}))

    with caplog.at_level(logging.WARNING):
        _train(cfg, STEPS)
    warned = [r.getMessage() for r in caplog.records if "POINTER DAMAGED" in r.getMessage()]
    assert len(warned) == 1 and str(prev) in warned[0] and "(step 1, version 1)" in warned[0], warned

    entries = read_steps_log(root)
    assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
    used = [i for e in entries for i in e["used"]]
    assert len(used) == len(set(used)) and set(used) == produced  # nothing lost, nothing twice
    notices = [r for name, r in read_topic(cfg, "control") if name == "WeightUpdate"]
    by_version: dict[int, set[str]] = {}
    for r in notices:
        by_version.setdefault(r["version"], set()).add(r["sha256"])
    assert sorted(by_version) == list(range(1, STEPS + 2))  # v1, v2, then on from v3: none skipped
    assert all(len(s) == 1 for s in by_version.values())  # none announced twice with other weights
    _check_pointer(root)
    assert json.loads(prev.read_text())["step"] == STEPS - 1
    assert "fell_back_from_damaged_pointer" not in pointer.read_text()


def test_both_pointers_damaged_is_one_line(tmp_path):
    from consumers.trainer.state import TrainerCheckpoints
    from pipeline.errors import CheckpointDamaged

    (tmp_path / "checkpoint.json").write_text("{")
    (tmp_path / "checkpoint.json.prev").write_text("[]")
    with pytest.raises(CheckpointDamaged, match="the previous pointer too") as err:
        TrainerCheckpoints(tmp_path).read_pointer()
    assert "\n" not in str(err.value)
