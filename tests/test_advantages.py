"""Advantage estimators against hand-computed values."""

import math

import pytest

from consumers.trainer import advantages
from consumers.trainer.loss_config import advantage_config


def test_grpo_hand_computed():
    # rewards 1, 0, 0, 1: mean 0.5; sample std sqrt(1/3) = 0.57735; population std 0.5
    a = advantages.grpo([1.0, 0.0, 0.0, 1.0], eps=0.0)
    assert a == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-6)
    b = advantages.grpo([1.0, 0.0, 0.0, 1.0], eps=0.0, unbiased=False)
    assert b == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # rewards 3, 1: mean 2, sample std sqrt(2), eps 0.1 -> +-1 / 1.51421
    assert advantages.grpo([3.0, 1.0], eps=0.1) == pytest.approx([1 / (math.sqrt(2) + 0.1), -1 / (math.sqrt(2) + 0.1)])


def test_grpo_equal_rewards_give_zero_not_nan():
    assert advantages.grpo([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]


def test_dr_grpo_hand_computed():
    assert advantages.dr_grpo([1.0, 0.0, 0.0, 1.0]) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert advantages.dr_grpo([2.0, 5.0, 2.0]) == pytest.approx([-1.0, 2.0, -1.0])


def test_rloo_hand_computed():
    # r=1 against the mean of the other three (0, 0, 1) = 1/3 -> 2/3; r=0 against (1, 0, 1)/3 -> -2/3
    assert advantages.rloo([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert advantages.rloo([2.0, 5.0, 2.0]) == pytest.approx([2 - 3.5, 5 - 2.0, 2 - 3.5])


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "rloo"])
def test_single_sample_group_has_zero_advantage(est):
    assert advantages.compute([0.7], advantage_config(estimator=est)) == [0.0]
    assert advantages.compute([], advantage_config(estimator=est)) == []


def test_compute_dispatches_on_config():
    r = [1.0, 0.0]
    assert advantages.compute(r, advantage_config(estimator="dr_grpo")) == [0.5, -0.5]
    assert advantages.compute(r, advantage_config(estimator="rloo")) == [1.0, -1.0]
    assert advantages.compute(r, advantage_config(estimator="grpo", eps=1e-6)) == pytest.approx([0.7071063, -0.7071063])
