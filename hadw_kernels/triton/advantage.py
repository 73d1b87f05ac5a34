"""The advantage of a response from its group's rewards, by any row of the estimator table
(tables/estimators.py; docs/math.md, sections 2, 2a and 4), as the surrogate kernel forms
it inside its launch; and the one reduction James-Stein needs before that launch when the
caller gives no ``batch_totals``: the call's groups' totals.

Each program of the surrogate reads its group's G rewards again (a few loads, where a
launch of its own would cost more): the group's sum S and count n, the baseline by the
row (S over n; S - r over n - 1 where the response's own reward leaves the group; plus the
prompt's pseudo-counts (alpha, beta) for the history; shrunk toward the other groups by
the batch's totals for James-Stein), A_hat = r - b (over the group's std where asked) and
Phi = lambda exp(-sgn(A_hat) sgn(p_hat - C) |p_hat - C|), C the anchor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tables.estimators import BATCH_TOTALS
from .codes import (
    SCOPE_BATCH,
    SCOPE_GROUP,
    SCOPE_HISTORY,
    TOTAL_GROUPS,
    TOTAL_MEANS,
    TOTAL_NOISE,
    TOTAL_RESPONSES,
    TOTAL_REWARDS,
    TOTAL_SQUARED_MEANS,
)
from .token_math import sign

__all__ = ["call_totals", "group_advantage_terms"]


@triton.jit
def _shrunk(own, totals_ptr, total, mean, noise, group_size, dtype: tl.constexpr):
    """James-Stein's baseline from ``own`` (the leave-one-out mean) and the batch's totals
    less this group's: v the other groups' mean noise, s the spread of their means,
    lambda = v / (v + s) (0 where both are 0, or with no other group), and the other
    groups' reward mean."""
    groups = tl.load(totals_ptr + TOTAL_GROUPS).to(dtype)
    others = tl.maximum(groups - 1, 1)
    other_noise = (tl.load(totals_ptr + TOTAL_NOISE).to(dtype) - noise) / others
    other_mean_of_means = (tl.load(totals_ptr + TOTAL_MEANS).to(dtype) - mean) / others
    other_spread = tl.maximum(
        (tl.load(totals_ptr + TOTAL_SQUARED_MEANS).to(dtype) - mean * mean) / others
        - other_mean_of_means * other_mean_of_means, 0.0)
    spread = other_noise + other_spread
    shrinkage = tl.where(spread > 0, other_noise / tl.where(spread > 0, spread, 1.0), 0.0)
    other_rewards = (tl.load(totals_ptr + TOTAL_REWARDS).to(dtype) - total) / tl.maximum(
        tl.load(totals_ptr + TOTAL_RESPONSES).to(dtype) - group_size, 1.0)
    return (1 - shrinkage) * own + shrinkage * other_rewards


@triton.jit
def group_advantage_terms(rewards_ptr, stride_rewards, anchor_ptr, totals_ptr, prior_ptr, stride_prior_row,
                       stride_prior_column, row, group_size, std_eps, lambda_scale, dtype: tl.constexpr,
                       NORMALIZE_STD: tl.constexpr, HAS_ANCHOR: tl.constexpr, SCOPE: tl.constexpr,
                       LEAVE_ONE_OUT: tl.constexpr, BLOCK_G: tl.constexpr):
    """(A_i = A_hat_i * Phi_i, Phi_i, whether the group is degenerate) of response ``row``
    by the estimator of ``SCOPE`` and ``LEAVE_ONE_OUT``: degenerate groups by min == max
    (the float32 mean of three rewards of 0.9 is not 0.9, so std == 0 would miss them),
    which the in-group baselines give exactly 0."""
    group = row // group_size
    members = tl.arange(0, BLOCK_G)
    in_group = members < group_size
    rewards = tl.load(rewards_ptr + (group * group_size + members) * stride_rewards, mask=in_group,
                      other=0.0).to(dtype)
    total = tl.sum(rewards, axis=0)
    mean = total / group_size
    centred = tl.where(in_group, rewards - mean, 0.0)
    degenerate = tl.max(tl.where(in_group, rewards, -float("inf")), axis=0) == tl.min(
        tl.where(in_group, rewards, float("inf")), axis=0
    )
    variance = tl.sum(centred * centred, axis=0) / (group_size - 1)  # unbiased
    if (SCOPE == SCOPE_GROUP) and not LEAVE_ONE_OUT:
        advantage_hat = centred  # r - S / n, as the group mean's reference forms it
    else:
        sums = total + tl.zeros([BLOCK_G], dtype)
        counts = tl.zeros([BLOCK_G], dtype) + group_size
        if LEAVE_ONE_OUT:
            sums = sums - rewards
            counts = counts - 1
        if SCOPE == SCOPE_HISTORY:
            alpha = tl.load(prior_ptr + row * stride_prior_row).to(dtype)
            beta = tl.load(prior_ptr + row * stride_prior_row + stride_prior_column).to(dtype)
            sums = alpha + sums
            counts = alpha + beta + counts
        own = sums / counts
        if SCOPE == SCOPE_BATCH:
            own = _shrunk(own, totals_ptr, total, mean, variance / (group_size - 1), group_size, dtype)
        advantage_hat = tl.where(in_group, rewards - own, 0.0)
    if NORMALIZE_STD:
        std = tl.sqrt(variance)
        advantage_hat = advantage_hat / (std + tl.full([], std_eps, dtype))
    if SCOPE == SCOPE_GROUP:
        advantage_hat = tl.where(degenerate, 0.0, advantage_hat)
    if HAS_ANCHOR:
        difficulty = mean - tl.load(anchor_ptr).to(dtype)
        exponent = -sign(advantage_hat) * sign(difficulty) * tl.abs(difficulty)
        phi = tl.full([], lambda_scale, dtype) * tl.exp(exponent)
    else:
        phi = tl.full([BLOCK_G], 1.0, dtype)
    own_member = members == row - group * group_size
    return (tl.sum(tl.where(own_member, advantage_hat * phi, 0.0), axis=0),
            tl.sum(tl.where(own_member, phi, 0.0), axis=0), degenerate)


@triton.jit
def _totals_kernel(rewards_ptr, stride_rewards, totals_ptr, groups, group_size, BLOCK_GROUPS: tl.constexpr,
                   BLOCK_G: tl.constexpr):
    """The call's groups' BATCH_TOTALS in float64, by one program in a fixed order."""
    members = tl.arange(0, BLOCK_G)
    rewards_sum = tl.zeros([BLOCK_GROUPS], tl.float64)
    noise_sum = tl.zeros([BLOCK_GROUPS], tl.float64)
    means_sum = tl.zeros([BLOCK_GROUPS], tl.float64)
    squares_sum = tl.zeros([BLOCK_GROUPS], tl.float64)
    for first in range(0, groups, BLOCK_GROUPS):
        ids = first + tl.arange(0, BLOCK_GROUPS)
        valid = ids < groups
        held = valid[:, None] & (members[None, :] < group_size)
        offsets = (ids[:, None].to(tl.int64) * group_size + members[None, :]) * stride_rewards
        rewards = tl.load(rewards_ptr + offsets, mask=held, other=0.0).to(tl.float64)
        sums = tl.sum(rewards, axis=1)
        means = sums / group_size
        centred = tl.where(held, rewards - means[:, None], 0.0)
        noise = tl.sum(centred * centred, axis=1) / (group_size - 1) / (group_size - 1)
        rewards_sum += tl.where(valid, sums, 0.0)
        noise_sum += tl.where(valid, noise, 0.0)
        means_sum += tl.where(valid, means, 0.0)
        squares_sum += tl.where(valid, means * means, 0.0)
    count = tl.zeros([], tl.float64) + groups
    tl.store(totals_ptr + TOTAL_GROUPS, count)
    tl.store(totals_ptr + TOTAL_RESPONSES, count * group_size)
    tl.store(totals_ptr + TOTAL_REWARDS, tl.sum(rewards_sum, axis=0))
    tl.store(totals_ptr + TOTAL_NOISE, tl.sum(noise_sum, axis=0))
    tl.store(totals_ptr + TOTAL_MEANS, tl.sum(means_sum, axis=0))
    tl.store(totals_ptr + TOTAL_SQUARED_MEANS, tl.sum(squares_sum, axis=0))


def call_totals(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """The BATCH_TOTALS [6] (float64) of the call's contiguous groups of ``group_size``
    rewards [S]: one launch of one program."""
    totals = torch.empty(len(BATCH_TOTALS), dtype=torch.float64, device=rewards.device)
    groups = rewards.shape[0] // group_size
    block_g = triton.next_power_of_2(group_size)
    block_groups = max(1, min(triton.next_power_of_2(max(groups, 1)), 4096 // block_g))
    _totals_kernel[(1,)](rewards, rewards.stride(0), totals, groups, group_size, BLOCK_GROUPS=block_groups,
                         BLOCK_G=block_g, num_warps=4)
    return totals
