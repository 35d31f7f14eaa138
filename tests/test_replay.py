"""`rlstream replay`: with ``--from-run`` a fresh trainer on an existing rl.scored log makes the same
steps as the original run (same groups, samples used, stale and incomplete per step, same losses)
even where the original took groups in arrival order, with its own topics and checkpoint directory;
the source log is only read. A schedule the log cannot follow stops the trainer with ScheduleError
once it has read the log to its end. Without ``--from-run`` groups go in group_seq order
(``trainer.group_order = "sequence"``), which depends on the log alone, not on fetch order."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import run_cli
from tests.test_trainer import TINY, ScoredProducer, scored


# ---- pure selection logic ---------------------------------------------------------------------
def _sample(gid: str, i: int, size: int = 2, seq: int = 0, part: int = 0, off: int = 0):
    return SimpleNamespace(
        prompt_group=gid, trajectory_id=f"{gid}/{i}", group_size=size, group_seq=seq, version_min=0, partition=part,
        offset=off, reward=float(i),
    )  # fmt: skip


def _feed(asm, samples):
    return [asm.add(s, 0.0) for s in samples]


def test_sequence_order_does_not_depend_on_fetch_order():
    """The same groups fetched in different orders give the same steps; a step waits for an older
    group still open, and for the end of the log."""
    from consumers.trainer.assembler import GroupAssembler
    from consumers.trainer.selection import SequenceSelector

    samples = [_sample(f"g{g}", i, seq=g, off=2 * g + i) for g in range(6) for i in range(2)]
    picks = []
    for seed in range(5):
        order = list(samples)
        random.Random(seed).shuffle(order)
        asm, sel = GroupAssembler(300.0), SequenceSelector(2)
        _feed(asm, order)
        steps = []
        for _ in range(3):
            _, groups = sel.select(asm, 0, True, 0)
            steps.append([g.id for g in groups])
        picks.append(steps)
    assert all(p == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]] for p in picks)

    asm, sel = GroupAssembler(300.0), SequenceSelector(2)
    _feed(asm, [s for s in samples if s.trajectory_id != "g0/1"])  # g0 still open
    assert sel.select(asm, 0, True, 0) == ([], None)  # g1, g2 are closed, but g0 comes first
    assert sel.select(asm, 0, False, 0) == ([], None)
    _feed(asm, [samples[1]])
    assert sel.select(asm, 0, False, 0) == ([], None)  # not at the end of the log: no step
    assert [g.id for g in sel.select(asm, 0, True, 0)[1]] == ["g0", "g1"]


def test_sequence_order_filters_in_order():
    """Dynamic sampling under sequence order filters only the groups ahead of the step's G."""
    from consumers.trainer.assembler import GroupAssembler
    from consumers.trainer.selection import SequenceSelector

    asm, sel = GroupAssembler(300.0), SequenceSelector(2)
    _feed(asm, [_sample(f"g{g}", i, seq=g) for g in range(5) for i in range(2)])
    keep = lambda g: g.id not in ("g1", "g4")  # noqa: E731
    filtered, groups = sel.select(asm, 0, True, 0, keep)
    assert [g.id for g in filtered] == ["g1"] and [g.id for g in groups] == ["g0", "g2"]
    assert [g.id for g in asm.ready] == ["g3", "g4"]  # g4 not judged yet: it belongs to a later step


def test_expected_members_close_a_group_and_refuse_the_rest():
    from consumers.trainer.assembler import GroupAssembler

    asm = GroupAssembler(0.0)  # every group would expire at once
    asm.expect({"g0": frozenset({"g0/0"}), "g1": frozenset({"g1/0", "g1/1"})})
    assert _feed(asm, [_sample("g1", 0)]) == ["added"]
    assert asm.expire(10.0) == []  # scheduled groups never expire
    assert _feed(asm, [_sample("g0", 0), _sample("g0", 1), _sample("g1", 1)]) == ["complete", "late", "complete"]
    g0, g1 = asm.take_ids(["g0", "g1"])
    assert not g0.complete and g1.complete and [s.trajectory_id for s in g0.samples] == ["g0/0"]


def test_schedule_from_a_steps_log():
    from consumers.trainer.assembler import GroupAssembler
    from consumers.trainer.selection import ScheduleError, ScheduleSelector, schedule_from_steps_log

    steps = [
        {"step": 1, "version": 0, "groups": ["b", "a"], "used": ["b/0", "a/1"], "stale": ["a/0"],
         "filtered_groups": ["c"], "filtered": ["c/0", "c/1"]},
        {"step": 2, "version": 1, "groups": ["d"], "incomplete_dropped": ["d/0"]},
    ]  # fmt: skip
    group_of = {t: {t.split("/")[0]} for t in ("a/0", "a/1", "b/0", "b/1", "c/0", "c/1", "d/0", "d/1")}
    sched = schedule_from_steps_log(steps, group_of)
    assert sched[0].groups == ("b", "a") and sched[0].filtered_groups == ("c",)
    assert sched[0].members == {"a": {"a/0", "a/1"}, "b": {"b/0"}, "c": {"c/0", "c/1"}}
    assert sched[1].members == {"d": {"d/0"}} and sched[1].version == 1
    with pytest.raises(ScheduleError, match="do not belong together"):
        schedule_from_steps_log(steps, {})
    with pytest.raises(ScheduleError, match="from step 1"):
        schedule_from_steps_log(steps[1:], group_of)

    sel, asm = ScheduleSelector(sched), GroupAssembler(300.0)
    asm.expect(sel.expectations(0))
    _feed(asm, [_sample(g, i) for g in "abc" for i in range(2)])  # b/1 is refused: b closes with b/0
    assert sel.select(asm, 0, False, 0) is not None
    with pytest.raises(ScheduleError, match="version"):
        sel.select(asm, 5, False, 1)
    assert sel.select(asm, 1, False, 1) == ([], None)  # d has not arrived: wait ...
    with pytest.raises(ScheduleError, match=r"group d has none of its 1 samples after reading rl\.scored to its end"):
        sel.select(asm, 1, True, 1)  # ... until the log's end


def test_a_schedule_replays_tail_samples_in_the_steps_that_trained_them():
    """rollout.overprovision_tail = "train": group a (4 samples, quorum 2) trained a/0, a/1 and a/2
    in step 1 (a/2 joined it while it waited) and its tail a/3 in step 2 beside group b. Replayed,
    a/3 is read before step 1 (it waits until a is taken), and step 2 takes exactly it."""
    from consumers.trainer.assembler import GroupAssembler
    from consumers.trainer.selection import ScheduleSelector, schedule_from_steps_log

    steps = [
        {"step": 1, "version": 0, "groups": ["a"], "used": ["a/0", "a/1", "a/2"]},
        {"step": 2, "version": 1, "groups": ["b"], "used": ["b/0", "b/1", "a/3"], "tails": 1},
    ]
    group_of = {t: {t.split("/")[0]} for t in ("a/0", "a/1", "a/2", "a/3", "b/0", "b/1")}
    sched = schedule_from_steps_log(steps, group_of)
    assert sched[0].tails == frozenset() and sched[1].tails == {"a/3"} and sched[1].members == {"b": {"b/0", "b/1"}}
    sel, asm = ScheduleSelector(sched), GroupAssembler(300.0)
    asm.expect(sel.expectations(0), sel.tail_ids(0))
    quorum = lambda i: SimpleNamespace(**_sample("a", i, size=4).__dict__, quorum=2)  # noqa: E731
    assert _feed(asm, [quorum(i) for i in range(4)]) == ["added", "added", "complete", "added"]
    _, [g] = sel.select(asm, 0, False, 0)
    assert [s.trajectory_id for s in g.samples] == ["a/0", "a/1", "a/2"] and sel.take_tails(asm, 0) == []
    assert sel.select(asm, 1, False, 1) == ([], None)  # b is not in yet
    _feed(asm, [_sample("b", 0), _sample("b", 1)])
    _, [gb] = sel.select(asm, 1, False, 1)
    [t] = sel.take_tails(asm, 1)
    assert gb.id == "b" and t.sample.trajectory_id == "a/3" and t.baseline_rewards == (0.0, 1.0, 2.0)


# ---- against the broker -----------------------------------------------------------------------
@pytest.mark.kafka
@pytest.mark.slow
def test_replay_reproduces_the_steps_of_the_original_run(make_config, cli_env, topic_prefix, tmp_path):
    """The original takes groups as they arrive: g6, g7 first (they were there first), then g0..g5
    in whatever order the three partitions are fetched, then g9 and g8, the latter closed
    incomplete by its timeout (its second sample arrives afterwards: late). Replayed with
    ``--from-run`` every step is the same; replayed in sequence order the first step is g0, g1."""
    from consumers.trainer.state import read_steps_log
    from consumers.trainer.worker import Trainer
    from rlstream.replay import run as replay

    common = [*TINY, "rl.group_size=2", "rl.groups_per_step=2", "rl.max_staleness=1", "trainer.lr=0.01",
              "trainer.group_timeout_s=3", "topics.scored.partitions=3"]  # fmt: skip
    cfg = make_config(*common)
    sp = ScoredProducer(cfg)

    def send(g: int, vmin: int, idx=(0, 1)):
        sp.send([scored(f"g{g}", i, 2, vmin, float(i), seq=g) for i in idx])

    send(6, 0)
    send(7, 0)
    assert Trainer(cfg, max_steps=1).run() == 1
    for g, vmin in enumerate([0, 0, 0, 1, 1, 2]):  # 3 groups of version 0, only 2 fit step 2: stale later
        send(g, vmin)
    assert Trainer(cfg, max_steps=4).run() == 4
    send(8, 3, idx=(0,))
    send(9, 3)
    assert Trainer(cfg, max_steps=5).run() == 5
    send(8, 3, idx=(1,))  # after its group was trained incomplete: late
    sp.close()
    original = read_steps_log(Path(cfg.run_dir) / "trainer")
    assert original[0]["groups"] == ["g6", "g7"] and sorted(original[4]["groups"]) == ["g8", "g9"]
    assert any(s["stale"] for s in original) and original[4]["incomplete_dropped"] == ["g8/0"]

    sets = [x for s in common for x in ("--set", s)]
    out = run_cli(["replay", topic_prefix, "--from-run", cfg.run_dir, *sets], cli_env, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 5 and result["groups"] == 10 and result["order"] == "schedule"
    assert result["prefix"] != topic_prefix
    [replay_dir] = Path(cli_env["RLSTREAM_RUN_DIR"]).glob("replay-*")
    replayed = read_steps_log(replay_dir / "trainer")
    for key in ("groups", "used", "stale", "incomplete_dropped", "filtered_groups", "version"):
        assert [s[key] for s in replayed] == [s[key] for s in original], key
    assert [s["loss"] for s in replayed] == pytest.approx([s["loss"] for s in original], rel=1e-5, abs=1e-7)

    seq_cfg = make_config(*common, f"topics.prefix={json.dumps('seq-' + topic_prefix)}",
                          f"run_dir={json.dumps(str(tmp_path / 'seq'))}", create=False)  # fmt: skip
    assert replay(seq_cfg, topic_prefix)["order"] == "sequence"
    in_seq = read_steps_log(Path(seq_cfg.run_dir) / "trainer")
    assert [s["groups"] for s in in_seq] == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"], ["g6", "g7"], ["g8", "g9"]]


@pytest.mark.kafka
def test_a_schedule_the_log_cannot_follow_fails_loudly(make_config):
    """A scheduled group that is not in the log: ScheduleError once the log has been read to its
    end, naming the group, not an endless wait."""
    from consumers.trainer.selection import ScheduledStep, ScheduleError
    from consumers.trainer.worker import Trainer

    cfg = make_config(*TINY, "rl.group_size=2", "rl.groups_per_step=2", "trainer.poll_timeout_s=0.2")
    sp = ScoredProducer(cfg)
    sp.send([scored("g0", i, 2, 0, float(i), seq=0) for i in range(2)])
    sp.close()
    members = {"g0": frozenset({"g0/0", "g0/1"}), "gone": frozenset({"gone/0"})}
    t0 = time.monotonic()
    with pytest.raises(ScheduleError, match="group gone has none of its 1 samples"):
        Trainer(cfg, schedule=[ScheduledStep(1, 0, ("g0", "gone"), (), members)]).run()
    assert time.monotonic() - t0 < 120
