"""The tracking role's sample tables without Kafka: a ``Tracker`` given a sample source writes
``samples/train`` every ``tracking.samples_every`` trainer steps and ``samples/eval`` from the eval
role's answers file once per evaluated version, as TensorBoard text (markdown tables that
TensorBoard reads back); a failing source costs its table, not the run; 0 turns them off."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorboard")


def event(role, version, ts, **metrics):
    return {"role": role, "worker_id": role, "version": version, "timestamp_ms": ts, "metrics": metrics, "labels": {}}


def texts(log_dir) -> dict[str, dict[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    return {t: {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors(t)} for t in ea.Tags()["tensors"]}


class Source:
    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at, self.closed = [], fail_at, False

    def __call__(self, k):
        self.calls.append(k)
        if len(self.calls) == self.fail_at:
            raise OSError("broker away")
        row = {
            "version_min": 3,
            "version_max": 4,
            "reward": 1.0,
            "advantage": None,
            "prompt": "a|b",
            "completion": "x\ny",
        }
        return [row] * k

    def close(self):
        self.closed = True


def run_tracker(tmp_path, source, **tc):
    from consumers.tracking.worker import Tracker, TrackingConfig

    answers = tmp_path / "eval" / "v2.jsonl"
    answers.parent.mkdir()
    answers.write_text("".join(
        json.dumps({"prompt_text": f"p{i}", "response_text": "r", "reference": "ref", "finish_reason": "stop",
                    "reward": 0.5}) + "\n" for i in range(5)
    ))  # fmt: skip
    tr = Tracker(TrackingConfig(**tc), tmp_path, samples=source)
    t0 = 1_764_000_000_000
    for step in range(1, 13):
        tr.add(event("trainer", step, t0 + step, step=float(step), reward_mean=0.5, version_lag_0=4.0))
    for _ in range(2):  # the evaluator's heartbeat repeats the figures: one table a version
        tr.add(event("eval", 2, t0 + 20, eval_reward_mean=0.5, eval_answers=5.0))
    tr.add(event("eval", 3, t0 + 30, eval_reward_mean=0.5, eval_answers=5.0))  # answers elsewhere: no table
    tr.close()
    return texts(tmp_path / "tensorboard")


def test_sample_tables_every_n_steps_and_per_evaluated_version(tmp_path):
    source = Source(fail_at=2)
    tables = run_tracker(tmp_path, source, samples_every=4, samples_rows=3)
    assert source.calls == [3, 3, 3] and source.closed
    assert set(tables["samples/train"]) == {4, 12}, "the table of step 8 failed; the others were written"
    train = tables["samples/train"][4].splitlines()
    assert train[0] == "| version | reward | advantage | prompt | completion |"
    assert train[2] == "| 3-4 | 1 | - | a\\|b | x ⏎ y |" and len(train) == 2 + 3
    assert set(tables["samples/eval"]) == {2}
    ev = tables["samples/eval"][2].splitlines()
    assert ev[0] == "| version | reward | prompt | completion | reference |"
    assert ev[2:] == [f"| 2 | 0.5 | p{i} | r | ref |" for i in range(3)]


def test_samples_every_0_writes_no_tables(tmp_path):
    source = Source()
    tables = run_tracker(tmp_path, source, samples_every=0)
    assert not source.calls and "samples/train" not in tables and "samples/eval" not in tables
