"""Reward functions without Kafka: registry, module:function, weighted sums, task routing, the
text built-ins and math-verify, and the scoring pools' error and timeout handling."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest

from consumers.reward.config import RewardConfig
from libs.rewards.base import (
    RewardError,
    RewardResult,
    TaskRouter,
    WeightedReward,
    as_result,
    build,
    parse_reference,
    register,
    registered,
)
from libs.rewards.builtin import last_boxed
from libs.rewards.pool import ProcessPool, ThreadPool
from pipeline.errors import ConfigError
from rlstream.config import load_config


def traj(response: str, reference=None, task: str = "t", **kw) -> dict:
    ref = "" if reference is None else reference if isinstance(reference, str) else json.dumps(reference)
    return {"trajectory_id": "g/0", "group_id": "g", "task": task, "prompt_text": "q", "response_text": response,
            "reference": ref, **kw}  # fmt: skip


# ---- registry, plug-ins, combination -------------------------------------------------------------
def test_registry_lists_builtins_and_rejects_unknown_names():
    assert {"exact_match", "regex", "format", "math", "code", "http", "openai_judge"} <= set(registered())
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        build("nope")
    with pytest.raises(ConfigError, match="bad kwargs"):
        build("exact_match", {"no_such_option": 1})
    with pytest.raises(ConfigError, match="extract must be"):
        build("exact_match", {"extract": "middle"})


def test_register_a_new_factory():
    @register("test_const")
    def const(value: float = 2.0):
        return lambda t: RewardResult(value, {"v": value})

    assert build("test_const", {"value": 3.0})(traj("x")) == RewardResult(3.0, {"v": 3.0})
    with pytest.raises(ValueError, match="already registered"):
        register("test_const")(lambda: None)


def test_module_function_rewards_and_result_normalisation():
    assert build("tests.test_reward_fns:length_ratio", {"target": 4})(traj("ab")) == RewardResult(0.5)
    assert build("tests.test_reward_fns:with_details")(traj("abc")) == RewardResult(0.5, {"chars": 3.0})
    with pytest.raises(ValueError, match="not finite"):
        build("tests.test_reward_fns:picky")(traj("NAN"))
    with pytest.raises(TypeError, match="must return"):
        build("tests.test_reward_fns:not_a_number")(traj("x"))
    with pytest.raises(ConfigError, match="cannot import"):
        build("tests.no_such_module:f")
    with pytest.raises(ConfigError, match="has no attribute"):
        build("tests.test_reward_fns:missing")
    assert as_result(True) == RewardResult(1.0)


def test_weighted_combination_sums_and_keeps_details():
    combo = WeightedReward(
        [
            ("a", 0.5, lambda t: RewardResult(1.0, {"x": 2.0})),
            ("b", 2.0, lambda t: RewardResult(0.25)),
            ("a", -1.0, lambda t: RewardResult(0.5)),
        ]
    )
    res = combo(traj("x"))
    assert res.reward == pytest.approx(0.5 * 1.0 + 2.0 * 0.25 - 1.0 * 0.5)
    assert res.details == {"a": 1.0, "a.x": 2.0, "b": 0.25, "a#2": 0.5}
    with pytest.raises(ConfigError):
        WeightedReward([])


def test_task_router_maps_tasks_with_default():
    cfg = load_config(
        None,
        [
            'reward.default=[{name="exact_match"}]',
            'reward.tasks.math=[{name="math", weight=1.0}, {name="format", weight=0.5, kwargs={style="boxed"}}]',
            'reward.tasks.len=[{name="tests.test_reward_fns:length_ratio", kwargs={target=2}}]',
        ],
        environ={},
    )
    router = TaskRouter(cfg.reward)
    assert router(traj("\\boxed{0.5}", {"answer": "1/2"}, task="math")).reward == pytest.approx(1.5)
    assert router(traj("0.5", {"answer": "1/2"}, task="math")).reward == pytest.approx(1.0)
    assert router(traj("x", task="len")).reward == 0.5
    assert router(traj("Hello  World", {"answer": "hello world"}, task="other")).reward == 1.0
    assert router.uses("math") and not router.uses("code")
    no_default = TaskRouter(RewardConfig(default=[], tasks={"len": [{"name": "tests.test_reward_fns:length_ratio"}]}))
    with pytest.raises(RewardError, match="no reward configured for task 'other'"):
        no_default(traj("x", task="other"))


def test_reference_parsing():
    assert parse_reference(traj("x", {"answer": "3"})) == {"answer": "3"}
    assert parse_reference(traj("x", "42")) == {"answer": 42}
    assert parse_reference(traj("x")) == {}
    with pytest.raises(RewardError, match="not valid JSON"):
        parse_reference(traj("x", "{oops"))


# ---- text built-ins ------------------------------------------------------------------------------
def test_exact_match_options():
    em = build("exact_match")
    assert em(traj("  The  Answer\n", {"answer": "the answer"})).reward == 1.0
    assert em(traj("the answers", {"answer": "the answer"})).reward == 0.0
    assert em(traj("B", {"answer": ["a", "b"]})).reward == 1.0
    strict = build("exact_match", {"case_sensitive": True, "normalize_whitespace": False})
    assert strict(traj("Abc", {"answer": "abc"})).reward == 0.0
    assert strict(traj("abc", {"answer": "abc"})).reward == 1.0
    assert strict(traj("a  b", {"answer": "a b"})).reward == 0.0
    boxed = build("exact_match", {"extract": "boxed"})
    assert boxed(traj("so \\boxed{x^{2}} done", {"answer": "x^{2}"})).reward == 1.0
    assert boxed(traj("no box", {"answer": "x"})).details == {"extracted": 0.0}
    last = build("exact_match", {"extract": "last_line"})
    assert last(traj("work\n\n42\n", {"answer": "42"})).reward == 1.0
    rx = build("exact_match", {"extract_regex": r"Answer:\s*(\S+)"})
    assert rx(traj("Answer: 1\nAnswer: 7", {"answer": "7"})).reward == 1.0
    with pytest.raises(RewardError, match="no 'answer'"):
        em(traj("x", {"tests": []}))
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}" and last_boxed("\\boxed{") is None


def test_regex_and_format_checks():
    assert build("regex", {"pattern": r"\d+"})(traj("abc 12")).reward == 1.0
    assert build("regex", {"pattern": r"\d+", "mode": "fullmatch"})(traj("abc 12")).reward == 0.0
    assert build("regex", {"pattern": "ABC", "ignore_case": True, "on_miss": -1.0})(traj("xyz")).reward == -1.0
    with pytest.raises(ConfigError, match="bad pattern"):
        build("regex", {"pattern": "("})
    think = build("format", {"style": "think_answer"})
    assert think(traj("<think>hmm\nok</think>\n<answer>4</answer>")).reward == 1.0
    assert think(traj("<answer>4</answer>")).reward == 0.0
    assert build("format", {"style": "boxed", "max_chars": 12})(traj("\\boxed{1}")).reward == 1.0
    assert build("format", {"style": "boxed", "max_chars": 5})(traj("\\boxed{1}")).reward == 0.0
    assert build("format", {"style": "code_block"})(traj("```py\nprint(1)\n```")).reward == 1.0


def test_env_reward_reads_the_environments_reward_from_metadata():
    score = build("env_reward")
    assert score({**traj("x"), "metadata": {"env_reward": "0.75"}}).reward == 0.75
    with pytest.raises(RewardError, match="no env_reward"):
        score(traj("x"))
    with pytest.raises(RewardError, match="not a number"):
        score({**traj("x"), "metadata": {"env_reward": "many"}})
    assert build("env_reward", {"missing": 0.0})(traj("x")).reward == 0.0


# ---- math-verify -------------------------------------------------------------------------------
MATH_CASES = [
    # (gold, response, expected reward) -- checked by hand
    ("1/2", "0.5", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}", 1.0),
    ("\\frac12", "So $x = \\dfrac{1}{2}$.", 1.0),
    ("0.5", "so the answer is \\boxed{\\frac{1}{2}}", 1.0),
    ("12", "There are $12$ apples, so \\boxed{12}.", 1.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),
    ("-3", "\\boxed{-3}", 1.0),
    ("1/2", "\\boxed{\\frac{1}{3}}", 0.0),
    ("0.5", "\\boxed{0.55}", 0.0),
    ("2", "the answer is 3", 0.0),
    ("12", "\\boxed{13}", 0.0),
    ("-3", "\\boxed{3}", 0.0),
]


@pytest.mark.parametrize(("gold", "response", "expected"), MATH_CASES)
def test_math_verifier_hand_checked(gold, response, expected):
    res = build("math")(traj(response, {"answer": gold}))
    assert res.reward == expected


def test_math_verifier_unparsable_answers():
    m = build("math")
    assert m(traj("I do not know", {"answer": "7"})) == RewardResult(0.0, {"parsed": 0.0})
    with pytest.raises(RewardError, match="no 'answer'"):
        m(traj("\\boxed{1}", {}))


# ---- pools -------------------------------------------------------------------------------------
PICKY = RewardConfig(default=[{"name": "tests.test_reward_fns:picky"}], timeout_s=2.0, pool_size=2)


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_pool_isolates_errors_and_timeouts(kind):
    pool = ProcessPool(PICKY, 2, 2.0).start() if kind == "process" else ThreadPool(PICKY, 2, 2.0)
    try:
        texts = ["a", "RAISE", "bb", "HANG", "NAN", "ccc"]
        out = pool.score([traj(t) for t in texts])
        assert [o.ok for o in out] == [True, False, True, False, False, True]
        assert [o.reward for o in out if o.ok] == [1.0, 1.0, 1.0]
        assert out[2].details == {"tests.test_reward_fns:picky": 1.0, "tests.test_reward_fns:picky.len": 2.0}
        assert out[1].error_type == "reward_error" and "ValueError: picky refuses RAISE" in out[1].reason
        assert out[3].error_type == "reward_timeout" and "2.0 s" in out[3].reason
        assert out[4].error_type == "reward_error" and "not finite" in out[4].reason
        # The pool still works after a hung call (process: killed and replaced; thread: abandoned).
        again = pool.score([traj("d"), traj("ee")])
        assert [o.reward for o in again] == [1.0, 1.0]
        if kind == "process":
            assert pool.killed == 1 and all(s.proc.is_alive() for s in pool.slots)
        else:
            assert pool.abandoned == 1
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_pool_streams_large_batches_in_order_around_a_hung_call(kind):
    """Lanes take chunks: a hung call in the middle of one times out alone, the calls queued behind
    it are scored on the replacement, and every answer lands at its own index."""
    pool = ProcessPool(PICKY, 2, 2.0).start() if kind == "process" else ThreadPool(PICKY, 2, 2.0)
    try:
        texts = ["x" * (1 + i % 7) for i in range(100)]
        texts[37] = "HANG"
        out = pool.score([traj(t) for t in texts])
        assert [o.ok for o in out] == [i != 37 for i in range(100)]
        assert out[37].error_type == "reward_timeout"
        assert [o.details["tests.test_reward_fns:picky.len"] for o in out if o.ok] == [
            float(len(t)) for i, t in enumerate(texts) if i != 37
        ]
    finally:
        pool.close()


def test_process_pool_survives_dying_scoring_processes():
    pool = ProcessPool(PICKY, 1, 5.0).start()
    try:
        pid = pool.slots[0].proc.pid
        os.kill(pid, signal.SIGKILL)  # dies while idle: the next call is retried on a replacement
        out = pool.score([traj("a"), traj("b")])
        assert [o.ok for o in out] == [True, True]
        assert pool.slots[0].proc.pid != pid
        out = pool.score([traj("a"), traj("DIE"), traj("b")])  # kills its process every time
        assert [o.ok for o in out] == [True, False, True]
        assert out[1].error_type == "reward_error" and "died twice" in out[1].reason
    finally:
        pool.close()


def test_reward_config_rejects_bad_values():
    with pytest.raises(ValueError, match="max_poll_interval_ms"):
        RewardConfig(timeout_s=100, max_batch_size=64, pool_size=1, max_poll_interval_ms=60_000)
    with pytest.raises(ValueError, match="strictly increasing"):
        RewardConfig(reward_buckets=[1.0, 0.5])
    with pytest.raises(ValueError):
        RewardConfig(nope=1)
    assert math.isclose(RewardConfig().timeout_s, 10.0)
