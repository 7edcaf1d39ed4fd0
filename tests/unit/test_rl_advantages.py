"""Group-relative advantages: hand values, std normalization, executions excluded for lack of a valid reward."""

import math

import pytest
import torch
from torch.testing import assert_close

from gyre.rl import group_advantages

NAN = float("nan")


def test_mean_centred_hand_values():
    reward_BN = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 1.0]])
    # group 0: mean 0.5 -> [0.5, -0.5, 0, 0]; group 1: mean 1.6 / 4 = 0.4 -> [-0.2, -0.2, -0.2, 0.6]
    want = torch.tensor([[0.5, -0.5, 0.0, 0.0], [-0.2, -0.2, -0.2, 0.6]])
    assert_close(group_advantages(reward_BN), want)


def test_std_normalization_hand_values():
    reward_BN = torch.tensor([[1.0, 0.0, 1.0, 0.0], [3.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    # group 0: mean 0.5, centred [0.5, -0.5, 0.5, -0.5], population std 0.5 -> [1, -1, 1, -1] (less eps)
    # group 1: mean 2, centred [1, -1, 0, 0], population variance (1 + 1) / 4 = 0.5, std sqrt(0.5)
    eps = 1e-6
    s1 = math.sqrt(0.5)
    want = torch.tensor(
        [[0.5 / (0.5 + eps), -0.5 / (0.5 + eps)] * 2, [1 / (s1 + eps), -1 / (s1 + eps), 0.0, 0.0]],
        dtype=torch.float64,
    )
    got = group_advantages(reward_BN, normalize_std=True, eps=eps)
    assert got.dtype == torch.float64
    assert_close(got, want)


def test_equal_rewards_give_exactly_zero_even_normalized():
    reward_BN = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]])
    for normalize_std in (False, True):
        assert torch.equal(group_advantages(reward_BN, normalize_std=normalize_std), torch.zeros(2, 3))


def test_excluded_executions_get_zero_and_stay_out_of_the_statistics():
    # Excluded rewards are NaN (no valid reward) or any number; neither enters mean or std.
    reward_BN = torch.tensor([[1.0, NAN, 0.0, 0.0], [5.0, 1.0, 0.0, 100.0], [NAN, 0.3, NAN, NAN]])
    valid_BN = torch.tensor([[True, False, True, True], [True, True, True, False], [False, True, False, False]])
    # group 0: valid [1, 0, 0], mean 1/3 -> [2/3, 0, -1/3, -1/3]
    # group 1: valid [5, 1, 0], mean 2 -> [3, -1, -2, 0]
    # group 2: one valid reward -> all 0
    want = torch.tensor([[2 / 3, 0.0, -1 / 3, -1 / 3], [3.0, -1.0, -2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert_close(group_advantages(reward_BN, valid_BN), want)
    # normalized, group 1: population variance (9 + 1 + 4) / 3 = 14 / 3
    got = group_advantages(reward_BN, valid_BN, normalize_std=True)
    assert_close(got[1], torch.tensor([3.0, -1.0, -2.0, 0.0]) / (math.sqrt(14 / 3) + 1e-6))
    assert torch.equal(got[2], torch.zeros(4))
    assert torch.isfinite(got).all()


def test_all_excluded_group_is_zero():
    reward_BN = torch.tensor([[NAN, NAN]])
    valid_BN = torch.tensor([[False, False]])
    assert torch.equal(group_advantages(reward_BN, valid_BN, normalize_std=True), torch.zeros(1, 2))


def test_advantage_is_detached():
    reward_BN = torch.tensor([[1.0, 0.0]], requires_grad=True)
    assert not group_advantages(reward_BN).requires_grad


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((torch.tensor([1.0, 0.0]),), {}, "reward_BN must be 2-D"),
        ((torch.tensor([[1, 0]]),), {}, "reward_BN must be a floating-point tensor"),
        ((torch.zeros(2, 0),), {}, "N >= 1"),
        ((torch.zeros(2, 3), torch.ones(2, 3)), {}, "valid_BN must be a bool tensor"),
        ((torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool)), {}, "valid_BN must have the shape"),
        ((torch.tensor([[1.0, NAN]]),), {}, "non-finite rewards marked valid at [group, execution] [[0, 1]]"),
        ((torch.zeros(2, 3),), {"eps": 0.0}, "eps=0.0 is not allowed"),
    ],
)
def test_bad_input_raises_value_error_naming_it(args, kwargs, message):
    with pytest.raises(ValueError) as info:
        group_advantages(*args, **kwargs)
    assert message in str(info.value)
