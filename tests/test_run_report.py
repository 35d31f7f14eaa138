"""What a job run reports at its end, without Kafka: a step whose samples were all stale
has no reward (not 0.0) in the step log, the means, the curve and the plot; the eval role evaluates
the run's final version, and the launcher waits for that evaluation before it stops the job."""

from __future__ import annotations

import io
import json

import pytest


def trainer_event(step: int, reward: float, ts: int, **lags) -> dict:
    metrics = {
        "step": float(step),
        "reward_mean": reward,
        "loss": 0.1,
        **{f"version_lag_{d}": n for d, n in lags.items()},
    }
    return {"role": "trainer", "worker_id": "t", "version": step, "timestamp_ms": ts, "metrics": metrics, "labels": {}}


def eval_event(version: int, final: bool = False) -> dict:
    m = {"eval_reward_mean": 0.5, "eval_pass_at_1": 0.25, "eval_answers": 8.0, **({"eval_final": 1.0} if final else {})}
    return {"role": "eval", "worker_id": "eval", "version": version, "timestamp_ms": 1, "metrics": m, "labels": {}}


def test_an_all_stale_step_has_no_reward_in_the_log_the_means_and_the_plot(tmp_path):
    from rlstream.progress import Progress
    from rlstream.report import plot_report

    p = Progress()
    p.add(trainer_event(1, 0.5, 1000, **{"0": 8}))
    p.add(trainer_event(2, 0.0, 2000))  # every sample stale: the trainer's 0.0 is a mean over nothing
    p.add(trainer_event(3, 0.7, 3000, **{"1": 8}))
    assert [s["reward_mean"] for s in p.steps] == [0.5, None, 0.7]
    assert p.recent_reward() == pytest.approx(0.6)
    plots = plot_report(tmp_path, {"steps": p.steps, "title": "t"})
    assert (tmp_path / "reward.png") in plots


def test_the_report_leaves_all_stale_steps_out_of_its_means(tmp_path):
    from rich.console import Console

    from rlstream.config import load_config
    from rlstream.launcher import Launcher

    cfg = load_config(None, [f"run_dir={tmp_path}"], environ={})
    launcher = Launcher(cfg, tmp_path, [], title="t", live=False, console=Console(file=io.StringIO()))
    for i, (reward, lags) in enumerate([(0.5, {"0": 8}), (0.0, {}), (0.9, {"0": 8})], start=1):
        launcher.progress.add(trainer_event(i, reward, 1000 * i, **lags))
    launcher.report = {"status": "ok"}
    r = launcher.finish_report({})
    assert r["reward_curve"] == [[1, 0.5], [2, None], [3, 0.9]]
    assert r["reward_first10_mean"] == pytest.approx(0.7) == r["reward_last10_mean"]
    assert json.loads((tmp_path / "report.json").read_text())["steps"][1]["reward_mean"] is None


def test_the_eval_role_evaluates_the_final_version_whatever_every_versions_says():
    from consumers.eval.worker import due, is_final

    assert due(None, 0, 5, False)  # the first version seen
    assert not due(0, 4, 5, False) and due(0, 5, 5, False)  # every 5 versions
    assert due(5, 7, 5, is_final({"version": 7, "step": 7}, max_steps=7))  # the last one, not a multiple of 5
    assert not due(7, 7, 5, True)  # evaluated already
    assert not is_final({"version": 7, "step": 7}, max_steps=0)  # a run without an end has no final version
    assert not is_final(None, max_steps=7) and not is_final({"version": 3, "step": 3}, max_steps=7)


class FakeSupervisor:
    def __init__(self):
        self.retired: list[str] = []

    def retire(self, name, timeout, cause):
        self.retired.append(name)


def test_the_launcher_waits_for_the_final_evaluation_with_the_producers_stopped(tmp_path):
    from rich.console import Console

    from rlstream.config import load_config
    from rlstream.launcher import Launcher, RoleSpec, standard_roles

    cfg = load_config(None, [f"run_dir={tmp_path}", "trainer.max_steps=7"], environ={})
    roles = [*standard_roles(cfg, 1, 1), RoleSpec("eval", "eval")]
    out = io.StringIO()
    launcher = Launcher(cfg, tmp_path, roles, title="t", live=False, console=Console(file=out))
    sup = FakeSupervisor()
    launcher.progress.add(eval_event(3, final=True))  # an earlier run's end (the topic is read from its start)
    launcher.progress.add(trainer_event(7, 0.5, 7000, **{"0": 8}))  # this run's last step: version 7
    launcher.progress.add(eval_event(5))
    assert not launcher._final_eval_done(sup)  # the trainer just finished; v7 not evaluated yet
    assert sorted(sup.retired) == ["feed", "reward-0", "rollout-0"]  # the eval gets the machine
    assert "waiting for the evaluation of the final version" in out.getvalue()
    assert not launcher._final_eval_done(sup) and len(sup.retired) == 3  # retired once
    launcher.progress.add(eval_event(7, final=True))
    assert launcher._final_eval_done(sup)
    no_eval = Launcher(cfg, tmp_path, standard_roles(cfg, 1, 1), title="t", live=False, console=Console(file=out))
    assert no_eval._final_eval_done(FakeSupervisor())  # no eval role: the run ends with the trainer


def reward_event(worker: str, ts: int, gap_max: float) -> dict:
    m = {"transactions": 1.0, "commit_gap_s_count": 1.0, "commit_gap_s_max": gap_max}
    return {"role": "reward", "worker_id": worker, "version": -1, "timestamp_ms": ts, "metrics": m, "labels": {}}


def rollout_event(worker: str, ts: int, gap_max: float) -> dict:
    m = {"trajectories": 8.0, "produce_gap_s_count": 8.0, "produce_gap_s_max": gap_max}
    return {"role": "rollout", "worker_id": worker, "version": 1, "timestamp_ms": ts, "metrics": m, "labels": {}}


def test_the_report_gives_each_stages_longest_pause_after_the_first_step(tmp_path):
    """A rebalance that takes a reward worker's partitions away for seconds shows as the
    reward stage's longest commit gap and the trainer's longest gap between steps; what happened
    before the first step (start-up, model loading) does not count."""
    from rich.console import Console

    from rlstream.config import load_config
    from rlstream.launcher import Launcher

    cfg = load_config(None, [f"run_dir={tmp_path}"], environ={})
    out = io.StringIO()
    launcher = Launcher(cfg, tmp_path, [], title="t", live=False, console=Console(file=out, width=400))
    p = launcher.progress
    p.add(reward_event("reward-0", 500, 30.0))  # before the first step: start-up, not a pause
    p.add(rollout_event("rollout-0", 600, 25.0))
    p.add(trainer_event(1, 0.5, 1000))
    p.add(trainer_event(2, 0.5, 1500))
    p.add(reward_event("reward-0", 2000, 0.4))
    p.add(reward_event("reward-1", 12000, 11.5))  # the partitions came back 11.5 s later
    p.add(trainer_event(3, 0.5, 13300))
    p.add(trainer_event(4, 0.5, 13800))
    p.add(rollout_event("rollout-0", 14000, 2.5))
    assert p.longest_pauses() == {"trainer": 11.8, "trainer_before_step": 3, "reward": 11.5, "rollout": 2.5}
    launcher.report = {"status": "ok"}
    launcher.finish_report({})
    assert json.loads((tmp_path / "report.json").read_text())["longest_pause_s"]["trainer"] == 11.8
    assert "longest pause after the first step: trainer 11.8 s, reward 11.5 s, rollout 2.5 s" in out.getvalue()


def test_the_reward_worker_reports_the_gap_between_its_commits():
    from consumers.reward.config import RewardConfig
    from consumers.reward.metrics import RewardMetrics

    metrics = RewardMetrics("w", RewardConfig())
    metrics.committed([("t", 1.0, 2.0)], [], 5.0)
    assert "commit_gap_s_max" not in metrics.m.snapshot(reset_windows=False)  # one commit: no gap yet
    metrics.committed([("t", 1.0, 2.0)], [], 5.0)
    snap = metrics.m.snapshot()
    assert snap["commit_gap_s_count"] == 1 and 0 <= snap["commit_gap_s_max"] < 5


def test_a_heartbeat_interval_at_or_over_the_session_timeout_is_refused():
    from pydantic import ValidationError

    from consumers.reward.config import RewardConfig

    assert RewardConfig().heartbeat_ms() == 3000 and RewardConfig(session_timeout_ms=6000).heartbeat_ms() == 1500
    with pytest.raises(ValidationError, match=r"reward\.heartbeat_interval_ms=6000 must be below"):
        RewardConfig(session_timeout_ms=6000, heartbeat_interval_ms=6000)


def test_the_rollout_heartbeat_must_be_below_its_session_timeout():
    from pydantic import ValidationError

    from producers.config import RolloutConfig

    assert (RolloutConfig().heartbeat_interval_ms, RolloutConfig().session_timeout_ms) == (500, 15000)
    with pytest.raises(ValidationError, match=r"rollout\.heartbeat_interval_ms=6000 must be below"):
        RolloutConfig(session_timeout_ms=6000, heartbeat_interval_ms=6000)
