"""Group assembly, the incomplete-group policy, the staleness gate, and the exactly-once offset
rule (floor + disposed offsets above it), simulated with random crashes. No broker needed."""

import random

import pytest

from consumers.trainer.assembler import GroupAssembler, OffsetTracker
from consumers.trainer.batch import TrainSample, plan_step
from consumers.trainer.loss_config import advantage_config


def S(gid, idx, offset, partition=0, size=3, vmin=0, reward=0.0, seq=-1, quorum=0):
    return TrainSample(
        trajectory_id=f"{gid}/{idx}",
        prompt_group=gid,
        partition=partition,
        offset=offset,
        prompt=[1],
        response=[2, 3],
        logprobs=[-1.0, -1.0],
        mask=[1, 1],
        reward=reward,
        version_min=vmin,
        version_max=vmin,
        group_size=size,
        group_seq=seq,
        quorum=quorum,
    )


def test_groups_close_when_complete_in_closing_order():
    a = GroupAssembler(timeout_s=10)
    assert a.add(S("A", 0, 0), 0) == "added"
    assert a.add(S("B", 0, 1), 0) == "added"
    assert a.add(S("B", 1, 2), 0) == "added"
    assert a.add(S("A", 1, 3), 0) == "added"
    assert a.add(S("B", 2, 4), 0) == "complete"
    assert a.take(2) is None
    assert a.add(S("A", 2, 5), 0) == "complete"
    got = a.take(2)
    assert [g.id for g in got] == ["B", "A"] and all(g.complete for g in got)
    assert a.add(S("A", 0, 9), 1) == "late"  # a group already taken for a step


def test_oldest_groups_are_taken_first():
    a = GroupAssembler(timeout_s=10)
    for i in range(2):
        a.add(S("new", i, i, size=2, vmin=5, seq=7), 0)
    for i in range(2):
        a.add(S("old", i, 10 + i, size=2, vmin=3 + i, seq=7), 0)  # closes later, but version_min 3
    a.add(S("mid", 0, 20, size=1, vmin=5, seq=7), 0)
    a.add(S("first", 0, 21, size=1, vmin=9, seq=2), 0)  # the feed's order wins over versions
    assert [g.id for g in a.take(2)] == ["first", "old"]
    assert [g.id for g in a.take(2)] == ["new", "mid"]  # equal seq and version_min: closing order


def test_duplicate_and_timeout():
    a = GroupAssembler(timeout_s=5)
    a.add(S("A", 0, 0), 0.0)
    assert a.add(S("A", 0, 1), 1.0) == "duplicate"
    a.add(S("B", 0, 2), 3.0)
    assert a.expire(4.9) == []
    closed = a.expire(5.0)
    assert [g.id for g in closed] == ["A"] and not closed[0].complete
    assert a.add(S("A", 1, 3), 5.5) == "late"  # closed (queued) groups refuse late samples
    assert [g.id for g in a.take(1)] == ["A"]


def test_plan_step_drops_stale_before_advantages_and_applies_incomplete_policy():
    a = GroupAssembler(timeout_s=1)
    # group F: fresh samples with rewards 1, 0 and one stale sample (version_min 0 at v=3, k=1)
    for i, (vmin, r) in enumerate([(2, 1.0), (0, 1.0), (3, 0.0)]):
        a.add(S("F", i, i, vmin=vmin, reward=r), 0)
    a.add(S("I", 0, 10, vmin=3, reward=1.0), 0)  # incomplete group
    a.expire(2)
    groups = a.take(2)
    adv = advantage_config(estimator="dr_grpo")
    plan = plan_step(groups, version=3, k=1, incomplete_policy="drop", adv_cfg=adv)
    assert [s.trajectory_id for s in plan.stale] == ["F/1"]
    assert [s.trajectory_id for s in plan.train] == ["F/0", "F/2"]
    assert [s.advantage for s in plan.train] == [0.5, -0.5]  # baseline over the fresh samples only
    assert [s.trajectory_id for s in plan.incomplete_dropped] == ["I/0"] and plan.incomplete_groups == 1
    assert plan.version_lag_counts() == {0: 1, 1: 1}
    plan2 = plan_step(groups, version=3, k=1, incomplete_policy="train", adv_cfg=adv)
    assert [s.trajectory_id for s in plan2.train] == ["F/0", "F/2", "I/0"] and plan2.train[-1].advantage == 0.0
    # k = 0 at version 3: only version_min 3 survives
    plan3 = plan_step(groups, version=3, k=0, incomplete_policy="train", adv_cfg=adv)
    assert sorted(s.trajectory_id for s in plan3.stale) == ["F/0", "F/1"]


def test_a_quorum_group_closes_at_its_quorum_and_its_tail_trains_against_its_rewards():
    """rollout.overprovision_tail = "train": groups of 4 with a quorum of 2."""
    a = GroupAssembler(timeout_s=100)
    Q = lambda g, i, off, r: S(g, i, off, size=4, reward=r, quorum=2)  # noqa: E731
    assert a.add(Q("A", 0, 0, 1.0), 0) == "added"
    assert a.add(Q("A", 1, 1, 0.0), 0) == "complete"  # its quorum
    assert a.add(Q("A", 2, 2, 1.0), 0) == "added"  # the group still waits for a step: it joins it
    assert a.add(Q("A", 2, 3, 1.0), 0) == "duplicate"
    [g] = a.take(1)
    assert g.complete and [s.trajectory_id for s in g.samples] == ["A/0", "A/1", "A/2"]
    assert a.add(Q("A", 3, 4, 0.0), 0) == "tail"
    assert a.add(Q("A", 3, 5, 0.0), 0) == "duplicate"
    assert a.add(S("A", 9, 6, size=4), 0) == "late"  # no quorum: an ordinary late sample
    assert a.heads_state() == {"A": {"rewards": {"A/0": 1.0, "A/1": 0.0, "A/2": 1.0}, "size": 4}}  # A/3 pending
    [t] = a.take_tails()
    assert t.baseline_rewards == (1.0, 0.0, 1.0) and a.heads == {}  # all 4 taken: forgotten
    plan = plan_step(
        [], version=0, k=0, incomplete_policy="drop", adv_cfg=advantage_config(estimator="dr_grpo"), tails=[t]
    )
    assert [s.trajectory_id for s in plan.train] == ["A/3"] and plan.tails == 1
    assert plan.train[0].advantage == pytest.approx(0.0 - 2.0 / 4)  # its own reward in the baseline, as in a group
    # a restart restores the head, and a tail read again is accepted again; a stale one is dropped
    b = GroupAssembler(100, trained_ids=["B"], heads={"B": {"rewards": {"B/0": 1.0, "B/1": 1.0}, "size": 3}})
    assert b.add(S("B", 2, 7, size=3, vmin=0, reward=0.0, quorum=2), 0) == "tail"
    stale = plan_step([], 5, 1, "drop", advantage_config(estimator="grpo"), tails=b.take_tails())
    assert [s.trajectory_id for s in stale.stale] == ["B/2"] and stale.train == [] and stale.tails == 0


def test_offset_floor_makes_assembling_groups_re_readable():
    t = OffsetTracker()
    a = GroupAssembler(timeout_s=100)
    layout = {0: ("A", 0), 1: ("A", 1), 2: ("B", 0), 3: ("A", 2), 4: ("B", 1), 5: ("C", 0), 6: ("B", 2), 7: ("C", 1)}
    for off, (g, i) in layout.items():
        assert not t.seen(0, off)
        a.add(S(g, i, off), 0)
    [ga] = a.take(1)  # A (offsets 0, 1, 3) trained; B queued, C assembling
    for s in ga.samples:
        t.dispose(s.partition, s.offset)
    snap = t.snapshot()
    assert snap == {"0": {"floor": 2, "done": [3]}}
    # restart: seek to 2, skip 3, everything else is read again
    t2 = OffsetTracker(snap)
    assert t2.start_offsets() == {0: 2}
    reread = [off for off in range(2, 9) if not t2.seen(0, off)]
    assert reread == [2, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("seed", range(25))
def test_random_crashes_use_every_record_in_exactly_one_committed_step(seed):
    """Simulated broker log (3 partitions, offset gaps like transaction markers), random arrival
    interleaving, a checkpoint after some steps, crashes at random moments."""
    rng = random.Random(seed)
    G, parts = 2, 3
    logs: dict[int, list[tuple[int, TrainSample]]] = {p: [] for p in range(parts)}
    n_groups = 2 * G * rng.randint(3, 6)
    open_groups = []
    next_off = dict.fromkeys(range(parts), 0)
    quorum = {}  # half the groups close at a quorum (rollout.overprovision_tail = "train")
    for gi in range(n_groups):
        size = rng.randint(1, 4)
        quorum[f"g{gi}"] = rng.choice([0, rng.randint(1, size)])
        open_groups.append([f"g{gi}", rng.randrange(parts), size, 0])
        while open_groups and (rng.random() < 0.5 or gi == n_groups - 1):
            grp = rng.choice(open_groups)
            gid, p, size, k = grp
            off = next_off[p]
            logs[p].append((off, S(gid, k, off, partition=p, size=size, quorum=quorum[gid])))
            next_off[p] = off + rng.choice([1, 1, 2])  # gaps: commit markers
            grp[3] += 1
            if grp[3] == size:
                open_groups.remove(grp)
    all_ids = sorted(s.trajectory_id for recs in logs.values() for _, s in recs)

    committed: list[list[str]] = []
    state = None
    while True:
        tracker, asm = (
            OffsetTracker(state and state["offsets"]),
            GroupAssembler(1e9, 10_000, state and state["trained"], state and state["heads"]),
        )
        pos = {p: tracker.start_offsets().get(p, 0) for p in range(parts)}
        steps_since_ckpt: list[list[str]] = []
        crash_at = rng.randint(1, 40)
        events = 0
        while True:
            live = [p for p in range(parts) if any(o >= pos[p] for o, _ in logs[p])]
            groups = asm.take(G)
            if groups is None and not live:
                groups = [] if asm.tails else None  # the last tails go in a step of their own
            if groups is None and not live:
                break
            if groups is None:
                p = rng.choice(live)
                off, s = next((o, s) for o, s in logs[p] if o >= pos[p])
                pos[p] = off + 1
                if not tracker.seen(p, off):
                    assert asm.add(TrainSample(**{**s.__dict__}), 0) != "late", s
                continue
            trained = [s for g in groups for s in g.samples] + [t.sample for t in asm.take_tails()]
            steps_since_ckpt.append([s.trajectory_id for s in trained])
            for s in trained:
                tracker.dispose(s.partition, s.offset)
            if rng.random() < 0.7:  # checkpoint
                committed.extend(steps_since_ckpt)
                steps_since_ckpt = []
                state = {"offsets": tracker.snapshot(), "trained": asm.trained_ids(), "heads": asm.heads_state()}
            events += 1
            if events >= crash_at:
                break  # crash: what was not checkpointed is lost
        if events < crash_at:  # drained everything: the final checkpoint, then a clean exit
            committed.extend(steps_since_ckpt)
            break
    used = sorted(i for step in committed for i in step)
    assert used == all_ids
