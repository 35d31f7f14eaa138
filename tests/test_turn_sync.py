"""``rollout.env.turn_sync``, the turn-synchronous baseline of ``rlstream bench agentic``: env steps
are held until no sample generates, run as one batch, and come back together; the default
(environment-level async) runs each step as soon as its turn ends."""

import threading
import time

import pytest

from producers.env_steps import EnvSteps
from producers.envs import Environment, StepResult


def _wait(steps: EnvSteps, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := steps.finished():
            return got
        time.sleep(0.005)
    raise AssertionError("no step came back")


def test_turn_sync_holds_steps_until_dispatch_and_returns_the_batch_together():
    ran = []
    steps = EnvSteps(4, 5.0, turn_sync=True)
    try:
        steps.submit("a", lambda: ran.append("a") or time.sleep(0.02) or StepResult("x"))
        steps.submit("b", lambda: ran.append("b") or time.sleep(0.2) or StepResult("y"))
        time.sleep(0.05)
        assert ran == [] and len(steps) == 2 and steps.samples() == ["a", "b"]
        assert not steps.stepping() and steps.finished() == []  # held: generation may go on
        assert steps.dispatch() == 2 and steps.stepping()
        time.sleep(0.08)
        assert sorted(ran) == ["a", "b"] and steps.finished() == []  # a ended, b has not: nothing yet
        assert len(steps) == 2 and steps.stepping()
        got = _wait(steps)
        assert [s.sample for s in got] == ["a", "b"] and [s.result.observation for s in got] == ["x", "y"]
        assert not steps.stepping() and len(steps) == 0 and steps.dispatch() == 0
    finally:
        steps.close()


def test_the_default_runs_each_step_at_once():
    steps = EnvSteps(4, 5.0)
    try:
        steps.submit("a", lambda: time.sleep(0.02) or StepResult("x"))
        steps.submit("b", lambda: time.sleep(0.3) or StepResult("y"))
        assert [s.sample for s in _wait(steps)] == ["a"]  # before b has ended
        assert not steps.stepping() and steps.dispatch() == 0 and len(steps) == 1
    finally:
        steps.close()


class StepLog(Environment):
    """Three turns, each followed by a 0.15 s step whose (start, end) is recorded."""

    eos_ends_episode = False
    log: list[tuple[float, float]] = []
    lock = threading.Lock()

    def reset(self, prompt, sample_index):
        self.turn = 0
        return prompt["text"]

    def step(self, action):
        t0 = time.monotonic()
        time.sleep(0.15)
        self.turn += 1
        with self.lock:
            StepLog.log.append((t0, time.monotonic()))
        return StepResult("ok\n", 0.0, self.turn >= 3)


def overlapping_phases(log: list[tuple[float, float]], same: float = 0.03) -> int:
    """Steps that started while a step dispatched earlier (starting over ``same`` s before) ran."""
    return sum(1 for a in log for b in log if a[0] + same < b[0] < a[1])


@pytest.mark.kafka
@pytest.mark.parametrize("turn_sync", [True, False])
def test_turn_sync_worker_runs_env_steps_in_batches(make_config, turn_sync, monkeypatch):
    from producers import feed
    from tests.test_rollout import run_until_idle, trajectories

    StepLog.log = []
    dispatched: list[float] = []  # when each batch was released (turn_sync), before its threads start
    real_dispatch = EnvSteps.dispatch

    def dispatch(self):
        t = time.monotonic()
        if n := real_dispatch(self):
            dispatched.append(t)
        return n

    monkeypatch.setattr(EnvSteps, "dispatch", dispatch)
    cfg = make_config(
        "feed.source=tests/data/guess.jsonl", "rl.group_size=4", "rl.max_staleness=100",
        "rollout.max_new_tokens=60", "rollout.env.max_turns=3", "rollout.env.max_turn_tokens=12",
        "rollout.max_inflight=8", "rollout.env.workers=8", "rollout.exit_when_idle_s=2",
        'rollout.engine={type="sim", token_latency_s=0.01, median_tokens=4, sigma=0.8, clip_tokens=12}',
        'rollout.env.tasks={guess_number="tests.test_turn_sync:StepLog"}', f"rollout.env.turn_sync={str(turn_sync).lower()}",
    )  # fmt: skip
    feed.run(cfg)
    run_until_idle(cfg)
    got = trajectories(cfg, 16)
    assert len(got) == 16 and all(t["num_turns"] == 3 and t["finish_reason"] == "env_done" for t in got)
    assert len(StepLog.log) == 48
    if turn_sync:  # each step belongs to the last batch released before it started; a batch is
        # released only once every step of the one before has ended (however late a loaded machine
        # starts a batch's threads), and batches hold several episodes' steps
        batches = [
            [e for s, e in StepLog.log if d <= s < nxt]
            for d, nxt in zip(dispatched, [*dispatched[1:], 1e18], strict=True)
        ]
        assert sum(map(len, batches)) == 48 and all(batches)
        assert all(max(prev) <= d for prev, d in zip(batches[:-1], dispatched[1:], strict=True))
        assert max(map(len, batches)) >= 4
    else:  # each episode's step starts when its own turn ends, while other episodes' steps run
        assert not dispatched and overlapping_phases(StepLog.log) > 0


def test_the_bench_tool_env_is_deterministic_long_tailed_and_ends_after_its_turns():
    from pipeline.errors import ConfigError
    from rlstream.dev.bench.agent_env import DEFAULTS, SimToolEnv, mean_latency, tool_latency

    lat = [tool_latency({}, f"g{i}/0", t) for i in range(2000) for t in (1, 2)]
    assert all(DEFAULTS["min_s"] <= x <= DEFAULTS["max_s"] for x in lat)
    assert tool_latency({}, "g7/3", 2) == tool_latency({}, "g7/3", 2) != tool_latency({}, "g7/3", 3)
    assert lat.count(DEFAULTS["max_s"]) > 0 and lat.count(DEFAULTS["min_s"]) > 0  # both clips are reached
    assert 0.3 < mean_latency({}, 5000) < 0.8 and mean_latency({"median_s": 0.1, "max_s": 0.5}, 5000) < 0.2
    env = SimToolEnv({"turns": 2, "median_s": 0.001, "min_s": 0.001, "max_s": 0.002})
    assert env.reset({"group_id": "g@e0", "text": "hi"}, 1) == "hi"
    assert [env.step("x").done for _ in range(2)] == [False, True]
    with pytest.raises(ConfigError, match="unknown options"):
        SimToolEnv.check_options({"turn": 3})
