"""all_equal_groups is the one test of a group whose rewards are all equal: the advantages
it zeroes, the Phi it leaves at lambda, zero_std_frac and the trainer's tallies all read it
(docs/math.md, section 2)."""

import math

import pytest
import torch

from hadw_kernels import all_equal_groups, group_advantages, hadw_advantages, hadw_weights
from hadw_kernels.advantage.group import group_metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7, 0.9, -0.0, math.inf, -math.inf])
def test_equal_rewards_are_equal_whatever_their_mean_rounds_to(dtype, value):
    rewards = torch.tensor([value] * 3 + [value, value, 0.5], dtype=dtype)
    assert all_equal_groups(rewards, 3).tolist() == [True, False]


def test_the_std_test_misses_what_min_equals_max_catches():
    """Three float32 0.9s: their mean is not 0.9, so their std is not 0."""
    rewards = torch.tensor([0.9, 0.9, 0.9])
    assert rewards.std() != 0
    assert all_equal_groups(rewards, 3).tolist() == [True]


def test_a_nan_makes_its_group_unequal():
    rewards = torch.tensor([math.nan, math.nan, 1.0, math.nan, 1.0, 1.0])
    assert all_equal_groups(rewards, 2).tolist() == [False, False, True]


def test_zero_and_minus_zero_are_equal():
    assert all_equal_groups(torch.tensor([0.0, -0.0]), 2).tolist() == [True]


def test_no_rewards_give_no_groups():
    equal = all_equal_groups(torch.zeros(0), 4)
    assert equal.dtype == torch.bool and equal.shape == (0,)


def test_it_reads_no_gradient():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0], requires_grad=True)
    assert all_equal_groups(rewards, 2).tolist() == [True, False]


def test_an_index_gives_what_contiguous_groups_give():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (48,), generator=generator).double()
    order = torch.randperm(48, generator=generator)
    # Row j holds reward order[j], of contiguous group order[j] // 4: the same groups, scattered.
    scattered = all_equal_groups(rewards[order], dense=(torch.arange(48) // 4)[order], groups=12)
    assert torch.equal(scattered, all_equal_groups(rewards, 4))
    assert 0 < int(scattered.sum()) < 12


def test_every_reader_zeroes_the_same_groups():
    """Groups of non-dyadic equal rewards among varied ones: the advantage is exactly 0
    on the equal groups alone, under every form that has an in-group baseline; Phi is
    lambda there; zero_std_frac counts them."""
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.7, 0.7, 0.7, 0.3, 0.3, 0.9])
    equal = all_equal_groups(rewards, 3)
    assert equal.tolist() == [True, False, True, False]
    rows = equal.repeat_interleave(3)
    forms = [
        group_advantages(rewards, 3),
        group_advantages(rewards, 3, normalize_std=False),
        hadw_advantages(rewards, group_size=3, anchor=0.2),
        hadw_advantages(rewards, group_size=3, estimator="rloo"),
        hadw_advantages(rewards, group_index=torch.arange(12) // 3, anchor=0.2),
    ]
    for advantage in forms:
        assert torch.equal(advantage[rows], torch.zeros(6)) and (advantage[~rows] != 0).all()
    phi = hadw_weights(rewards, 3, 0.2, lambda_scale=1.3)
    assert torch.equal(phi[rows], torch.full((6,), 1.3))
    assert group_metrics(rewards, phi, 3)["zero_std_frac"] == 0.5


def test_the_trainer_counts_the_same_groups():
    from trainer.config import load_config
    from trainer.engine.loop import batch_advantages

    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.7, 0.7, 0.7, 0.3, 0.3, 0.9])
    algorithm = load_config(None, []).algorithm
    _, figures = batch_advantages(rewards, 3, algorithm, 1.3, belief=0.2)
    assert figures["zero_std_frac"] == float(all_equal_groups(rewards, 3).float().mean()) == 0.5
