"""Dynamic sampling on a real broker. Groups whose rewards are all equal are filtered before they
count towards a step: every step still trains G groups, filtered groups are counted (metrics,
steps log), and admission -- counted from the trainer's consumed groups (WeightUpdate
``consumed_groups`` and ``groups_consumed`` progress records, pipeline.control) -- keeps
supplying, so a run where most groups have zero variance neither deadlocks nor breaks the
staleness bound. The classic rule ``g < (v + k + 1) G`` would have stopped the producers (the
test shows how far past it admission had to go).

``test_trainer_and_admission_...`` drives the real trainer with a producer that follows rl.control
exactly as a rollout worker does (it admits group g at its newest loaded version v only if
``pipeline.control.may_admit(g, v, k, G, consumed(v))``) and writes scored groups with chosen
rewards; ``test_the_whole_pipeline_...`` runs feed, rollout, reward and trainer on the next-digit
task."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline import control
from tests import rl_pipeline
from tests.test_trainer import TINY, ScoredProducer, read_topic, scored

pytestmark = pytest.mark.kafka


def flat_rewards(g: int) -> list[float] | None:
    """Two of every three groups have zero variance (all 1 or all 0)."""
    return {0: [1.0, 0.0, 1.0, 0.0], 1: [1.0] * 4, 2: [0.0] * 4}[g % 3]


@pytest.mark.parametrize("k", [0, 1])
def test_trainer_and_admission_filter_zero_variance_groups_without_deadlock(make_config, k):
    from consumers.trainer.state import read_steps_log
    from consumers.trainer.worker import Trainer

    G, n, steps = 2, 4, 6
    cfg = make_config(
        *TINY,
        f"rl.max_staleness={k}",
        f"rl.group_size={n}",
        f"rl.groups_per_step={G}",
        "topics.scored.partitions=2",
        "trainer.poll_timeout_s=0.2",
        "trainer.dynamic_sampling=true",
        "trainer.lr=0.01",
    )
    stop = threading.Event()
    produced: list[tuple[int, int, int | None]] = []  # (group_seq, version it was generated at, C(version))
    problems: list[str] = []

    def producer():
        follower = control.ControlFollower(cfg, "test-producer")
        sp = ScoredProducer(cfg)
        try:
            g = 0
            while not stop.is_set():
                follower.poll(0.1)
                v = follower.latest_update["version"] if follower.latest_update else 0
                consumed = follower.consumed_groups(v)
                if not control.may_admit(g, v, k, G, consumed):
                    continue  # wait, as a rollout worker holds a prompt it may not start yet
                sp.send([scored(f"g{g:03d}", i, n, v, r, seq=g) for i, r in enumerate(flat_rewards(g))])
                produced.append((g, v, consumed))
                g += 1
        except Exception as exc:  # reported below
            problems.append(repr(exc))
        finally:
            sp.close()
            follower.close()

    feeder = threading.Thread(target=producer, daemon=True)
    feeder.start()
    trainer = Trainer(cfg, max_steps=steps)
    done = threading.Thread(target=lambda: trainer.run(), daemon=True)
    done.start()
    done.join(240)
    stuck = done.is_alive()
    if stuck:
        trainer.stop_event.set()
        done.join(60)
    stop.set()
    feeder.join(30)
    trainer.close()
    assert not stuck, f"deadlock: trainer at step {trainer.step} of {steps}, producer at group {len(produced)}"
    assert not problems, problems

    log = read_steps_log(Path(cfg.run_dir) / "trainer")
    assert [e["step"] for e in log] == list(range(1, steps + 1))
    consumed_total = 0
    for e in log:
        assert len(e["groups"]) == G  # steps stay full
        for gid in e["groups"]:  # only informative groups trained
            assert int(gid[1:]) % 3 == 0
        for gid in e["filtered_groups"]:
            assert int(gid[1:]) % 3 != 0
        assert len(e["filtered"]) == n * len(e["filtered_groups"])
        assert not e["stale"]  # admission kept every sample within k
        consumed_total += len(e["groups"]) + len(e["filtered_groups"])
        assert e["consumed_groups"] == consumed_total
        assert all(int(d) <= k for d in e["staleness"])
    filtered = sum(len(e["filtered_groups"]) for e in log)
    assert filtered >= steps * G  # two zero-variance groups per informative one
    assert trainer.metrics.counters["groups_filtered"] == filtered
    assert trainer.metrics.counters["samples_filtered"] == n * filtered
    # the producers learnt the count: from notices and from progress records while the trainer waited
    recs = read_topic(cfg, "control")
    notices = [r for name, r in recs if name == "WeightUpdate"]
    progress = [r for name, r in recs if name == "Command" and r["name"] == control.PROGRESS_COMMAND]
    assert [r["consumed_groups"] for r in notices][-1] == consumed_total
    assert progress, "the trainer never published its consumed-group count while waiting"
    # admission had to go past the classic (v + k + 1) * G: it would have deadlocked here
    assert any(g >= (v + k + 1) * G for g, v, _ in produced)
    for g, v, consumed in produced:  # and never past the consumed-count bound
        assert g < control.admission_limit(v, k, G, consumed)


@pytest.mark.slow
def test_the_whole_pipeline_keeps_steps_full_and_within_the_bound(make_config, topic_prefix, tmp_path):
    """Feed + rollout (hf) + reward + trainer on the next-digit task, where most groups are all-0 at
    first and all-1 later: filtered groups are counted, steps stay full, every trajectory was
    admitted within the consumed-count bound, no trained sample is stale."""
    from consumers.trainer.state import read_steps_log

    k, G, n, steps = 1, 4, 8, 25
    task = rl_pipeline.write_task(tmp_path / "task.jsonl")
    cfg = make_config(
        *rl_pipeline.settings(task, topic_prefix, steps, G=G, n=n, k=k), "trainer.dynamic_sampling=true",
        "trainer.lr=0.003",
    )  # fmt: skip
    out = rl_pipeline.run(cfg, steps, rollout_workers=1)
    log = read_steps_log(Path(cfg.run_dir) / "trainer")
    assert [e["step"] for e in log] == list(range(1, steps + 1))
    assert all(len(e["groups"]) == G for e in log)
    filtered = sum(len(e["filtered_groups"]) for e in log)
    print(f"[dynamic sampling e2e] {steps} steps in {out['seconds']:.0f} s, {filtered} groups filtered")
    assert filtered > 0 and out["trainer"].metrics.counters["groups_filtered"] == filtered
    assert all(not e["stale"] for e in log)
    # the admission bound, checked from the topics: every trajectory's group started at a version
    # whose consumed-group count allowed it
    recs = read_topic(cfg, "control")
    follower_counts: dict[int, int] = {}
    for name, r in recs:
        if name == "WeightUpdate" and r["consumed_groups"] >= 0:
            follower_counts[r["version"]] = max(follower_counts.get(r["version"], -1), r["consumed_groups"])
        elif name == "Command" and r["name"] == control.PROGRESS_COMMAND:
            v, c = int(r["args"]["version"]), int(r["args"]["consumed_groups"])
            follower_counts[v] = max(follower_counts.get(v, -1), c)
    trajs = [r for name, r in read_topic(cfg, "rollouts") if name == "Trajectory"]
    assert trajs
    for t in trajs:
        v = t["version_min"]
        assert t["group_seq"] < control.admission_limit(v, k, G, follower_counts.get(v)), t["trajectory_id"]
    assert any(t["group_seq"] >= (t["version_min"] + k + 1) * G for t in trajs)  # past the classic rule
