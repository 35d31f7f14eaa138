"""Experiment logging from rl.metrics: TensorBoard event files that TensorBoard itself reads back."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("tensorboard")


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def event(role, worker, version, ts, **metrics):
    return {"role": role, "worker_id": worker, "version": version, "timestamp_ms": ts, "metrics": metrics, "labels": {}}


def test_tracker_writes_steps_staleness_eval_and_roles(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from consumers.tracking.worker import Tracker, TrackingConfig

    tr = Tracker(TrackingConfig(), tmp_path)
    t0 = 1_764_000_000_000
    tr.add(event("rollout", "r0", 0, t0 - 900, trajectories_rate=1.0))  # before the trainer's first step
    tr.add(event("trainer", "t", 1, t0, step=1.0, reward_mean=0.25, loss=0.5, version_lag_0=6.0, version_lag_1=2.0))
    tr.add(event("rollout", "r0", 1, t0 + 5, trajectories_rate=2.0))
    tr.add(event("reward", "w0", -1, t0 + 7, scored_rate=4.0))
    tr.add(event("trainer", "t", 1, t0 + 10, step=1.0, reward_mean=0.25, loss=0.5))  # periodic repeat: skipped
    tr.add(event("rollout", "r0", 1, t0 + 15, trajectories_rate=3.0))  # the latest while step 1 was the newest
    tr.add(event("trainer", "t", 2, t0 + 20, step=2.0, reward_mean=0.75, loss=float("nan"), version_lag_0=8.0))
    # every sample of step 3 was stale: its reward and loss are means over nothing, not 0.0
    tr.add(event("trainer", "t", 2, t0 + 25, step=3.0, reward_mean=0.0, loss=0.0, loss_kl=0.0, grad_norm=0.0))
    tr.add(event("eval", "e", 2, t0 + 30, eval_reward_mean=0.4, eval_pass_at_1=0.3))
    tr.add(event("rollout", "r0", 2, t0 + 3500, trajectories_rate=12.5))  # after the last step: written at close
    tr.lags({"reward": 7})
    tr.close()
    got = scalars(tmp_path / "tensorboard")
    assert got["trainer/reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert got["trainer/loss"] == [(1, 0.5)]  # step 2's NaN is not written, nor step 3's nothing
    assert "trainer/loss_kl" not in got
    assert got["trainer/step_samples"] == [(1, 8.0), (2, 8.0), (3, 0.0)]
    assert got["staleness/lag_0"] == [(1, 6.0), (2, 8.0)] and got["staleness/lag_1"] == [(1, 2.0)]
    assert got["eval/reward_mean"] == [(2, pytest.approx(0.4))] and got["eval/pass_at_1"] == [(2, pytest.approx(0.3))]
    # the other roles on the trainer's step axis: one point per step, its latest value, steps growing
    assert got["rollout/r0/trajectories_rate"] == [(0, 1.0), (1, 3.0), (3, 12.5)]
    assert got["reward/w0/scored_rate"] == [(1, 4.0)]
    assert got["lag/reward"] == [(3, 7.0)]
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()  # each point keeps the wall time its event was reported at
    walls = [e.wall_time for e in ea.Scalars("rollout/r0/trajectories_rate")]
    assert walls == pytest.approx([(t0 - 900) / 1000, (t0 + 15) / 1000, (t0 + 3500) / 1000])


@pytest.mark.kafka
def test_rlstream_track_follows_the_metrics_topic(make_config):
    from consumers.tracking.worker import TrackWorker
    from pipeline.kafka import Producer, client_conf
    from pipeline.metrics import WorkerMetrics
    from tests.test_rollout import wait_for

    cfg = make_config()
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        m = WorkerMetrics("trainer", "trainer-0", p, cfg.topics.name("metrics"))
        for step in (1, 2, 3):
            m.set("step", step)
            m.set("reward_mean", step / 10)
            m.set("version_lag_0", 8)  # the step trained 8 samples (as the trainer reports them)
            m.publish()
    worker = TrackWorker(cfg)
    stop = threading.Event()
    t = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_for(lambda: worker.tracker is not None and worker.tracker._last_step == 3, timeout=60, what="3 steps")
    finally:
        stop.set()
        t.join(60)
    got = scalars(cfg.run_dir / "tensorboard")
    assert got["trainer/reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
