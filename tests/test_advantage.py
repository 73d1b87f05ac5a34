import math

import pytest
import torch

from hadw_kernels import group_advantages, hadw_advantages, hadw_weights


def test_std_normalised_advantage_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # unbiased, as torch.std
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6)
    torch.testing.assert_close(group_advantages(rewards, 4), expected)


def test_unnormalised_advantage_is_reward_minus_group_mean():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.2, 0.3])
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.5, -0.3, -0.2])
    torch.testing.assert_close(group_advantages(rewards, 3, normalize_std=False), expected)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_degenerate_group_is_exactly_zero(value, normalize_std):
    # 0.1 and 0.7 are not dyadic: their group mean is not bit-equal to them.
    rewards = torch.tensor([value] * 6 + [1.0, 0.0, 0.0])
    advantage = group_advantages(rewards, 3, normalize_std=normalize_std)
    assert torch.equal(advantage[:6], torch.zeros(6))
    assert (advantage[6:] != 0).all()


def test_phi_by_hand():
    # Group 1 is hard (p_hat = 0.25 < C = 0.5): its correct response is boosted, its
    # wrong ones damped. Group 2 is easy (p_hat = 0.75): the reverse.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    phi = hadw_weights(rewards, 4, 0.5, lambda_scale=1.3)
    up, down = 1.3 * math.exp(0.25), 1.3 * math.exp(-0.25)
    torch.testing.assert_close(phi, torch.tensor([up, down, down, down, down, down, down, up]))


def test_phi_is_lambda_where_advantage_or_difficulty_is_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    phi = hadw_weights(rewards, 3, torch.tensor(1 / 3), lambda_scale=1.5)
    assert torch.allclose(phi[:3], torch.full((3,), 1.5))  # degenerate group: sgn(A) = 0
    assert torch.allclose(phi[3:], torch.full((3,), 1.5))  # p_hat == C: M = 0


def test_phi_carries_no_gradient():
    rewards = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not hadw_weights(rewards, 2, 0.3).requires_grad


def test_a_tensor_anchor_that_requires_grad_gives_no_gradient():
    """The anchor is data, in Phi and in the advantages of a whole batch alike."""
    anchor = torch.tensor(0.3, requires_grad=True)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert not hadw_weights(rewards, 2, anchor).requires_grad
    assert not hadw_advantages(rewards, group_size=2, anchor=anchor).requires_grad
    assert not hadw_advantages(rewards, group_index=torch.tensor([0, 0, 1, 1]), anchor=anchor).requires_grad


def test_advantage_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
