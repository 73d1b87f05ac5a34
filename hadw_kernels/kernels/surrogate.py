"""Triton kernels for ``hadw::surrogate_loss``: the clipped surrogates with HA-DW
(SPEC sections 2, 4 and 5), loss and gradient in one pass over the tokens.

Three launches, in stream order, none of which reads a value back to the host:

1. ``_group_kernel``, one program per response group: group mean and unbiased std,
   the advantage A_hat, Phi from the anchor (read from device memory), A = A_hat * Phi,
   each response's valid-token count, and the batch's token count (an exact int64
   atomic) that dapo divides by.
2. ``_token_surrogate_kernel`` (grpo, dapo, dr_grpo) or ``_sequence_surrogate_kernel``
   (gspo), one program per response on grid axis 0 (2^31 - 1 programs, so any batch):
   the loss contribution of the response and d loss / d logprobs, d loss / d entropy
   for each of its tokens, and the response's metric partial sums.
3. ``_finish_kernel``, one program: sums the per-response partials in a fixed order
   (deterministic, unlike float atomics) into the loss and the metrics vector.

All arithmetic is in the compute dtype (float32, or float64 for float64 log-probs);
bf16 and fp16 inputs are widened on load. Offsets are int64 (row * stride), so B * T
may exceed 2^31. Masked positions are never read (masked loads yield 0), so padding may
hold any value, inf and NaN included. Block sizes are chosen per GPU generation by
``_token_launch``; docs/triton-surrogate.md gives the reasoning and a time estimate.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ..advantage import STD_EPS
from ..config import LOG_RATIO_CLAMP
from ..ops import METRIC_NAMES

__all__ = ["surrogate_forward"]

# Columns of the per-response partial sums the surrogate kernels write and
# _finish_kernel reduces. The row is padded to a power of two so that the finishing
# kernel loads it as one aligned tile.
_LOSS = tl.constexpr(0)
_CLIP_LOW = tl.constexpr(1)
_CLIP_HIGH = tl.constexpr(2)
_RATIO_SUM = tl.constexpr(3)
_RATIO_COUNT = tl.constexpr(4)  # tokens (token-level) or non-empty responses (gspo)
_APPROX_KL = tl.constexpr(5)
_REF_KL = tl.constexpr(6)
_ENTROPY = tl.constexpr(7)
_TOKENS = tl.constexpr(8)
_NUM_PARTIALS = tl.constexpr(9)
_PARTIALS_WIDTH = tl.constexpr(16)

# Importance weights: none, [B, T] or [B].
_NO_WEIGHTS = tl.constexpr(0)
_TOKEN_WEIGHTS = tl.constexpr(1)
_RESPONSE_WEIGHTS = tl.constexpr(2)

_STD_EPS = tl.constexpr(STD_EPS)
_LOG_RATIO_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)

assert METRIC_NAMES == (
    "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "phi_mean", "zero_std_frac", "ref_kl",
    "entropy_mean",
), "_finish_kernel writes the metrics in this order"


# --- device helpers -----------------------------------------------------------------------


@triton.jit
def _sign(x):
    # sgn(0) = 0 (SPEC section 4): Phi of a zero advantage is lambda_scale.
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0)).to(x.dtype)


@triton.jit
def _exp_minus_one_minus_x(x):
    """exp(x) - 1 - x without the cancellation of the literal formula near 0.

    Below |x| = 1/2 the Taylor series to x^12 (truncation < 2e-13 relative); above it
    the literal formula loses at most about 20 ulp. libdevice's expm1 is unavailable under
    the interpreter, and the literal formula would lose all digits of an on-policy
    log-ratio's k3 (~1e-7) in float32.
    """
    series = 1.0 / 479001600.0
    series = series * x + 1.0 / 39916800.0
    series = series * x + 1.0 / 3628800.0
    series = series * x + 1.0 / 362880.0
    series = series * x + 1.0 / 40320.0
    series = series * x + 1.0 / 5040.0
    series = series * x + 1.0 / 720.0
    series = series * x + 1.0 / 120.0
    series = series * x + 1.0 / 24.0
    series = series * x + 1.0 / 6.0
    series = series * x + 0.5
    small = x * x * series
    return tl.where(tl.abs(x) < 0.5, small, tl.exp(x) - 1.0 - x)


@triton.jit
def _clipped_objective(ratio, advantage, ratio_low, ratio_high, dual_clip, HAS_DUAL_CLIP: tl.constexpr):
    """-min(rho A, clip(rho) A), bounded by -c A for A < 0 under dual clip, and its
    derivative with respect to rho, as autograd gives it for the reference: the
    unclipped branch passes -A when it is the larger, or when rho lies inside the clip
    range (both branches equal, the clamp passes its gradient on [low, high])."""
    unclipped = -ratio * advantage
    clipped = -tl.minimum(tl.maximum(ratio, ratio_low), ratio_high) * advantage
    objective = tl.maximum(unclipped, clipped)
    passes = (unclipped > clipped) | ((ratio >= ratio_low) & (ratio <= ratio_high))
    d_objective = tl.where(passes, -advantage, 0.0)
    if HAS_DUAL_CLIP:
        bound = -dual_clip * advantage
        capped = (advantage < 0) & (objective > bound)
        objective = tl.where(capped, bound, objective)
        d_objective = tl.where(capped, 0.0, d_objective)
    return objective, d_objective


@triton.jit
def _token_weight(length, token_count_ptr, denominator, PER_RESPONSE_MEAN: tl.constexpr, COUNT_TOKENS: tl.constexpr):
    """d loss / d (per-token value) of one response's valid tokens (config.aggregate):
    1 / (T_i * B) for grpo; else 1 / denominator (dr_grpo: L_max * B; dapo: the
    caller's normaliser), or 1 / N_tok counted on the device (dapo, COUNT_TOKENS)."""
    if PER_RESPONSE_MEAN:
        weight = 1.0 / (tl.maximum(length, 1).to(denominator.dtype) * denominator)
    elif COUNT_TOKENS:
        tokens = tl.maximum(tl.load(token_count_ptr), 1)
        weight = 1.0 / tokens.to(denominator.dtype)
    else:
        weight = 1.0 / denominator
    return weight


# --- kernels ------------------------------------------------------------------------------


@triton.jit
def _group_kernel(
    rewards_ptr, stride_rewards,
    anchor_ptr,
    mask_ptr, stride_mask_row, stride_mask_col,
    advantage_ptr, length_ptr, group_stats_ptr, token_count_ptr,
    group_size, width,
    lambda_scale: tl.float64,
    NORMALIZE_STD: tl.constexpr,
    HAS_ANCHOR: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    members = tl.arange(0, BLOCK_G)
    in_group = members < group_size
    rows = group * group_size + members
    compute = advantage_ptr.dtype.element_ty

    rewards = tl.load(rewards_ptr + rows * stride_rewards, mask=in_group, other=0.0).to(compute)
    mean = tl.sum(rewards, axis=0) / group_size
    centred = tl.where(in_group, rewards - mean, 0.0)
    # min == max, not std == 0: the mean of equal non-dyadic rewards need not equal them.
    degenerate = tl.max(tl.where(in_group, rewards, -float("inf")), axis=0) == tl.min(
        tl.where(in_group, rewards, float("inf")), axis=0
    )
    advantage_hat = centred
    if NORMALIZE_STD:
        std = tl.sqrt(tl.sum(centred * centred, axis=0) / (group_size - 1))
        advantage_hat = centred / (std + _STD_EPS)
    advantage_hat = tl.where(degenerate, 0.0, advantage_hat)
    if HAS_ANCHOR:
        difficulty = mean - tl.load(anchor_ptr).to(compute)
        advantage_sign = tl.where(degenerate, 0.0, _sign(centred))
        exponent = -advantage_sign * _sign(difficulty) * tl.abs(difficulty)
        phi = tl.full([], lambda_scale, compute) * tl.exp(exponent)
    else:
        phi = tl.full([BLOCK_G], 1.0, compute)
    tl.store(advantage_ptr + rows, advantage_hat * phi, mask=in_group)
    tl.store(group_stats_ptr + group * 2, tl.sum(tl.where(in_group, phi, 0.0), axis=0).to(tl.float32))
    tl.store(group_stats_ptr + group * 2 + 1, degenerate.to(tl.float32))

    # Valid tokens per response: the per-response mean (grpo) and dapo's batch count
    # are then known before the surrogate kernel writes any gradient.
    lengths = tl.zeros([BLOCK_G], dtype=tl.int32)
    row_offsets = rows * stride_mask_row
    for start in range(0, width, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        offsets = row_offsets[:, None] + cols.to(tl.int64)[None, :] * stride_mask_col
        inside = in_group[:, None] & (cols < width)[None, :]
        valid = tl.load(mask_ptr + offsets, mask=inside, other=0) != 0
        lengths += tl.sum(valid.to(tl.int32), axis=1)
    tl.store(length_ptr + rows, lengths, mask=in_group)
    tl.atomic_add(token_count_ptr, tl.sum(lengths.to(tl.int64), axis=0))


@triton.jit
def _token_surrogate_kernel(
    logprobs_ptr, stride_logprobs_row, stride_logprobs_col,
    old_ptr, stride_old_row, stride_old_col,
    mask_ptr, stride_mask_row, stride_mask_col,
    ref_ptr, stride_ref_row, stride_ref_col,
    weights_ptr, stride_weights_row, stride_weights_col,
    entropy_ptr, stride_entropy_row, stride_entropy_col,
    advantage_ptr, length_ptr, token_count_ptr,
    grad_logprobs_ptr, grad_entropy_ptr, partials_ptr,
    width,
    ratio_low: tl.float64, ratio_high: tl.float64, beta: tl.float64, dual_clip: tl.float64,
    entropy_coef: tl.float64, denominator: tl.float64,
    PER_RESPONSE_MEAN: tl.constexpr,
    COUNT_TOKENS: tl.constexpr,
    HAS_DUAL_CLIP: tl.constexpr,
    HAS_KL: tl.constexpr,
    WEIGHTS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    compute = grad_logprobs_ptr.dtype.element_ty
    ratio_low = tl.full([], ratio_low, compute)
    ratio_high = tl.full([], ratio_high, compute)
    beta = tl.full([], beta, compute)
    dual_clip = tl.full([], dual_clip, compute)
    entropy_coef = tl.full([], entropy_coef, compute)
    # A block rather than a scalar: the interpreter turns a scalar boolean into float32
    # when broadcasting it in `&`, so (advantage < 0) must already be a block.
    advantage = tl.zeros([BLOCK_T], compute) + tl.load(advantage_ptr + row).to(compute)
    length = tl.load(length_ptr + row)
    weight = _token_weight(length, token_count_ptr, tl.full([], denominator, compute), PER_RESPONSE_MEAN, COUNT_TOKENS)
    if WEIGHTS == _RESPONSE_WEIGHTS:
        response_weight = tl.load(weights_ptr + row * stride_weights_row).to(compute)

    objective_sum = tl.zeros([BLOCK_T], compute)
    clip_low = tl.zeros([BLOCK_T], compute)
    clip_high = tl.zeros([BLOCK_T], compute)
    ratio_sum = tl.zeros([BLOCK_T], compute)
    approx_kl = tl.zeros([BLOCK_T], compute)
    ref_kl = tl.zeros([BLOCK_T], compute)
    entropy_sum = tl.zeros([BLOCK_T], compute)
    for start in range(0, width, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        wide_cols = cols.to(tl.int64)
        inside = cols < width
        valid = tl.load(mask_ptr + row * stride_mask_row + wide_cols * stride_mask_col, mask=inside, other=0) != 0
        logprobs = tl.load(
            logprobs_ptr + row * stride_logprobs_row + wide_cols * stride_logprobs_col, mask=valid, other=0.0
        ).to(compute)
        old = tl.load(old_ptr + row * stride_old_row + wide_cols * stride_old_col, mask=valid, other=0.0).to(compute)

        log_ratio = logprobs - old
        # torch.clamp's gradient: passed on the closed interval, zero outside it.
        in_clamp = (log_ratio >= -_LOG_RATIO_CLAMP) & (log_ratio <= _LOG_RATIO_CLAMP)
        log_ratio = tl.minimum(tl.maximum(log_ratio, -_LOG_RATIO_CLAMP), _LOG_RATIO_CLAMP)
        ratio = tl.exp(log_ratio)
        objective, d_objective = _clipped_objective(ratio, advantage, ratio_low, ratio_high, dual_clip, HAS_DUAL_CLIP)
        if WEIGHTS == _TOKEN_WEIGHTS:
            token_weight = tl.load(
                weights_ptr + row * stride_weights_row + wide_cols * stride_weights_col, mask=valid, other=0.0
            ).to(compute)
            objective *= token_weight
            d_objective *= token_weight
        elif WEIGHTS == _RESPONSE_WEIGHTS:
            objective *= response_weight
            d_objective *= response_weight
        grad = tl.where(in_clamp, d_objective * ratio, 0.0)
        if HAS_KL:
            ref = tl.load(
                ref_ptr + row * stride_ref_row + wide_cols * stride_ref_col, mask=valid, other=0.0
            ).to(compute)
            ref_delta = ref - logprobs
            kl = _exp_minus_one_minus_x(ref_delta)
            objective += beta * kl
            # d k3 / d logp = 1 - exp(ref - logp) = -expm1(ref_delta)
            grad -= beta * (ref_delta + kl)
            ref_kl += tl.where(valid, kl, 0.0)
        if HAS_ENTROPY:
            entropy = tl.load(
                entropy_ptr + row * stride_entropy_row + wide_cols * stride_entropy_col, mask=valid, other=0.0
            ).to(compute)
            objective -= entropy_coef * entropy
            entropy_sum += tl.where(valid, entropy, 0.0)
            tl.store(grad_entropy_ptr + row * width + wide_cols, tl.where(valid, -entropy_coef * weight, 0.0),
                     mask=inside)
        tl.store(grad_logprobs_ptr + row * width + wide_cols, tl.where(valid, grad * weight, 0.0), mask=inside)

        objective_sum += tl.where(valid, objective, 0.0)
        clip_low += (valid & (ratio < ratio_low) & (advantage < 0)).to(compute)
        clip_high += (valid & (ratio > ratio_high) & (advantage > 0)).to(compute)
        ratio_sum += tl.where(valid, ratio, 0.0)
        approx_kl += tl.where(valid, _exp_minus_one_minus_x(log_ratio), 0.0)

    partials = partials_ptr + row * _PARTIALS_WIDTH
    token_total = length.to(compute)
    tl.store(partials + _LOSS, tl.sum(objective_sum, axis=0) * weight)
    tl.store(partials + _CLIP_LOW, tl.sum(clip_low, axis=0))
    tl.store(partials + _CLIP_HIGH, tl.sum(clip_high, axis=0))
    tl.store(partials + _RATIO_SUM, tl.sum(ratio_sum, axis=0))
    tl.store(partials + _RATIO_COUNT, token_total)
    tl.store(partials + _APPROX_KL, tl.sum(approx_kl, axis=0))
    tl.store(partials + _REF_KL, tl.sum(ref_kl, axis=0))
    tl.store(partials + _ENTROPY, tl.sum(entropy_sum, axis=0))
    tl.store(partials + _TOKENS, token_total)


@triton.jit
def _sequence_surrogate_kernel(
    logprobs_ptr, stride_logprobs_row, stride_logprobs_col,
    old_ptr, stride_old_row, stride_old_col,
    mask_ptr, stride_mask_row, stride_mask_col,
    ref_ptr, stride_ref_row, stride_ref_col,
    weights_ptr, stride_weights_row,
    entropy_ptr, stride_entropy_row, stride_entropy_col,
    advantage_ptr, length_ptr,
    grad_logprobs_ptr, grad_entropy_ptr, partials_ptr,
    width,
    ratio_low: tl.float64, ratio_high: tl.float64, beta: tl.float64, dual_clip: tl.float64,
    entropy_coef: tl.float64, denominator: tl.float64,
    HAS_DUAL_CLIP: tl.constexpr,
    HAS_KL: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """gspo: s_i = exp(mean over valid tokens of the log-ratio). The sequence ratio
    needs the whole row before any token's gradient, so the row is read twice; the
    second read of a response's log-probs comes from L2 (one row is 16 KB at T=4096)."""
    row = tl.program_id(0).to(tl.int64)
    compute = grad_logprobs_ptr.dtype.element_ty
    ratio_low = tl.full([], ratio_low, compute)
    ratio_high = tl.full([], ratio_high, compute)
    beta = tl.full([], beta, compute)
    dual_clip = tl.full([], dual_clip, compute)
    entropy_coef = tl.full([], entropy_coef, compute)
    denominator = tl.full([], denominator, compute)
    advantage = tl.load(advantage_ptr + row).to(compute)
    length = tl.load(length_ptr + row)
    # The KL and entropy terms are per-token means of each response (config.aggregate).
    weight = 1.0 / (tl.maximum(length, 1).to(compute) * denominator)

    # Pass 1: the sequence log-ratio, and the metrics that need no sequence ratio.
    log_ratio_sum = tl.zeros([BLOCK_T], compute)
    approx_kl = tl.zeros([BLOCK_T], compute)
    for start in range(0, width, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        wide_cols = cols.to(tl.int64)
        valid = tl.load(mask_ptr + row * stride_mask_row + wide_cols * stride_mask_col, mask=cols < width, other=0) != 0
        logprobs = tl.load(
            logprobs_ptr + row * stride_logprobs_row + wide_cols * stride_logprobs_col, mask=valid, other=0.0
        ).to(compute)
        old = tl.load(old_ptr + row * stride_old_row + wide_cols * stride_old_col, mask=valid, other=0.0).to(compute)
        log_ratio = logprobs - old
        log_ratio_sum += log_ratio
        token_log_ratio = tl.minimum(tl.maximum(log_ratio, -_LOG_RATIO_CLAMP), _LOG_RATIO_CLAMP)
        approx_kl += tl.where(valid, _exp_minus_one_minus_x(token_log_ratio), 0.0)

    has_tokens = length > 0
    sequence_log_ratio = tl.sum(log_ratio_sum, axis=0) / tl.maximum(length, 1).to(compute)
    in_clamp = (sequence_log_ratio >= -_LOG_RATIO_CLAMP) & (sequence_log_ratio <= _LOG_RATIO_CLAMP)
    ratio = tl.exp(tl.minimum(tl.maximum(sequence_log_ratio, -_LOG_RATIO_CLAMP), _LOG_RATIO_CLAMP))
    objective, d_objective = _clipped_objective(ratio, advantage, ratio_low, ratio_high, dual_clip, HAS_DUAL_CLIP)
    if HAS_WEIGHTS:
        response_weight = tl.load(weights_ptr + row * stride_weights_row).to(compute)
        objective *= response_weight
        d_objective *= response_weight
    objective = tl.where(has_tokens, objective, 0.0)
    # d l_i / d logp_tok = d l_i / d s_i * s_i / T_i, for every valid token alike.
    sequence_grad = tl.where(
        has_tokens & in_clamp, d_objective * ratio / (tl.maximum(length, 1).to(compute) * denominator), 0.0
    )

    # Pass 2: every token's gradient, with the KL and entropy terms.
    token_terms = tl.zeros([BLOCK_T], compute)
    ref_kl = tl.zeros([BLOCK_T], compute)
    entropy_sum = tl.zeros([BLOCK_T], compute)
    for start in range(0, width, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        wide_cols = cols.to(tl.int64)
        inside = cols < width
        valid = tl.load(mask_ptr + row * stride_mask_row + wide_cols * stride_mask_col, mask=inside, other=0) != 0
        grad = tl.zeros([BLOCK_T], compute) + sequence_grad
        if HAS_KL:
            logprobs = tl.load(
                logprobs_ptr + row * stride_logprobs_row + wide_cols * stride_logprobs_col, mask=valid, other=0.0
            ).to(compute)
            ref = tl.load(
                ref_ptr + row * stride_ref_row + wide_cols * stride_ref_col, mask=valid, other=0.0
            ).to(compute)
            ref_delta = ref - logprobs
            kl = _exp_minus_one_minus_x(ref_delta)
            grad -= beta * weight * (ref_delta + kl)
            ref_kl += tl.where(valid, kl, 0.0)
            token_terms += tl.where(valid, beta * kl, 0.0)
        if HAS_ENTROPY:
            entropy = tl.load(
                entropy_ptr + row * stride_entropy_row + wide_cols * stride_entropy_col, mask=valid, other=0.0
            ).to(compute)
            entropy_sum += tl.where(valid, entropy, 0.0)
            token_terms -= tl.where(valid, entropy_coef * entropy, 0.0)
            tl.store(grad_entropy_ptr + row * width + wide_cols, tl.where(valid, -entropy_coef * weight, 0.0),
                     mask=inside)
        tl.store(grad_logprobs_ptr + row * width + wide_cols, tl.where(valid, grad, 0.0), mask=inside)

    partials = partials_ptr + row * _PARTIALS_WIDTH
    tl.store(partials + _LOSS, objective / denominator + tl.sum(token_terms, axis=0) * weight)
    tl.store(partials + _CLIP_LOW, (has_tokens & (ratio < ratio_low) & (advantage < 0)).to(compute))
    tl.store(partials + _CLIP_HIGH, (has_tokens & (ratio > ratio_high) & (advantage > 0)).to(compute))
    tl.store(partials + _RATIO_SUM, tl.where(has_tokens, ratio, 0.0))
    tl.store(partials + _RATIO_COUNT, has_tokens.to(compute))
    tl.store(partials + _APPROX_KL, tl.sum(approx_kl, axis=0))
    tl.store(partials + _REF_KL, tl.sum(ref_kl, axis=0))
    tl.store(partials + _ENTROPY, tl.sum(entropy_sum, axis=0))
    tl.store(partials + _TOKENS, length.to(compute))


@triton.jit
def _pick(totals, columns, index: tl.constexpr):
    return tl.sum(tl.where(columns == index, totals, 0.0), axis=0)


@triton.jit
def _finish_kernel(
    partials_ptr, group_stats_ptr, loss_ptr, metrics_ptr,
    batch, groups,
    BLOCK_ROWS: tl.constexpr,
):
    """Sums in a fixed order, in float64: the result does not depend on scheduling and
    the counts stay exact beyond 2^24 tokens."""
    columns = tl.arange(0, _PARTIALS_WIDTH)
    sums = tl.zeros([BLOCK_ROWS, _PARTIALS_WIDTH], tl.float64)
    for start in range(0, batch, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        tile_mask = (rows < batch)[:, None] & (columns < _NUM_PARTIALS)[None, :]
        tile = tl.load(partials_ptr + rows[:, None] * _PARTIALS_WIDTH + columns[None, :], mask=tile_mask, other=0.0)
        sums += tile.to(tl.float64)
    totals = tl.sum(sums, axis=0)

    group_columns = tl.arange(0, 2)
    group_sums = tl.zeros([BLOCK_ROWS, 2], tl.float64)
    for start in range(0, groups, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        tile = tl.load(group_stats_ptr + rows[:, None] * 2 + group_columns[None, :], mask=(rows < groups)[:, None],
                       other=0.0)
        group_sums += tile.to(tl.float64)
    group_totals = tl.sum(group_sums, axis=0)

    tl.store(loss_ptr, _pick(totals, columns, _LOSS).to(loss_ptr.dtype.element_ty))
    ratio_count = tl.maximum(_pick(totals, columns, _RATIO_COUNT), 1.0)
    token_count = tl.maximum(_pick(totals, columns, _TOKENS), 1.0)
    tl.store(metrics_ptr + 0, (_pick(totals, columns, _CLIP_LOW) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + 1, (_pick(totals, columns, _CLIP_HIGH) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + 2, (_pick(totals, columns, _RATIO_SUM) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + 3, (_pick(totals, columns, _APPROX_KL) / token_count).to(tl.float32))
    tl.store(metrics_ptr + 4, (_pick(group_totals, group_columns, 0) / batch).to(tl.float32))
    tl.store(metrics_ptr + 5, (_pick(group_totals, group_columns, 1) / groups).to(tl.float32))
    tl.store(metrics_ptr + 6, (_pick(totals, columns, _REF_KL) / token_count).to(tl.float32))
    tl.store(metrics_ptr + 7, (_pick(totals, columns, _ENTROPY) / token_count).to(tl.float32))


# --- launch configuration -----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _compute_capability(device: torch.device) -> tuple[int, int]:
    # A host-side property query: no device synchronisation.
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _token_launch(width: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_T, num_warps) for the per-response kernels (docs/triton-surrogate.md).

    One program streams one response. Hopper (sm_90) needs about twice Ampere's bytes
    in flight per SM to cover its bandwidth, so its tile is twice as wide. Four tokens
    a thread keep an fp32 load one 16-byte vector and the register count near 56
    (110 with KL, weights and entropy), so no variant spills.
    """
    widest = 2048 if _compute_capability(device) >= (9, 0) else 1024
    block = min(triton.next_power_of_2(max(width, 1)), widest)
    return block, max(1, min(16, block // 128))


def _group_launch(group_size: int, width: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_T) of the group kernel's [group, tokens] mask tile: about 4K
    mask bytes per step, whatever the group size."""
    block_g = triton.next_power_of_2(group_size)
    block_t = min(triton.next_power_of_2(max(width, 1)), max(16, 4096 // block_g))
    return block_g, block_t


_FINISH_BLOCK_ROWS = 256


def _strides_2d(tensor: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if tensor is None else (tensor.stride(0), tensor.stride(1))


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# --- the op's CUDA implementation ----------------------------------------------------------


def surrogate_forward(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    anchor: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    importance_weights: torch.Tensor | None,
    entropy: torch.Tensor | None,
    group_size: int,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    lambda_scale: float,
    beta: float,
    dual_clip: float | None,
    entropy_coef: float,
    loss_normalizer: float | None,
    max_response_length: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hadw::surrogate_loss`` (schema in ``ops``): the loss, its gradient with respect
    to the log-probs and the entropy, and the metrics in ``ops.METRIC_NAMES`` order.

    Inputs are assumed validated (``validation.check_surrogate_inputs``). Only shapes
    and Python scalars steer the launches; no tensor value reaches the host.
    """
    batch, width = logprobs.shape
    device = logprobs.device
    groups = batch // group_size
    compute = torch.promote_types(logprobs.dtype, torch.float32)
    # bool storage read as bytes: one byte per token, and any dtype works through `!= 0`.
    mask = response_mask.view(torch.uint8) if response_mask.dtype == torch.bool else response_mask
    # The batch denominator of config.aggregate; dapo without a normaliser divides by
    # the token count the group kernel accumulates on the device (COUNT_TOKENS).
    responses = float(loss_normalizer) if loss_normalizer is not None else float(batch)
    if loss_type == "dapo":
        denominator = float(loss_normalizer) if loss_normalizer is not None else 1.0
    elif loss_type == "dr_grpo":
        denominator = float(max_response_length or width) * responses
    else:
        denominator = responses
    has_kl = beta > 0

    # At least the compute dtype: float64 log-probs with float32 rewards get float64 advantages.
    advantage = torch.empty(batch, dtype=torch.promote_types(rewards.dtype, compute), device=device)
    lengths = torch.empty(batch, dtype=torch.int32, device=device)
    group_stats = torch.empty((groups, 2), dtype=torch.float32, device=device)
    token_count = torch.zeros((), dtype=torch.int64, device=device)
    grad_logprobs = torch.empty((batch, width), dtype=compute, device=device)
    grad_entropy = torch.empty(
        (batch, width) if entropy is not None else (0,), dtype=compute, device=device
    )
    partials = torch.empty((batch, _PARTIALS_WIDTH.value), dtype=compute, device=device)
    loss = torch.empty((), dtype=compute, device=device)
    metrics = torch.empty(len(METRIC_NAMES), dtype=torch.float32, device=device)

    block_g, group_block_t = _group_launch(group_size, width)
    block_t, num_warps = _token_launch(width, device)
    scalars = dict(
        ratio_low=1.0 - epsilon_low,
        ratio_high=1.0 + epsilon_high,
        beta=float(beta),
        dual_clip=float(dual_clip) if dual_clip is not None else 0.0,
        entropy_coef=float(entropy_coef),
        denominator=denominator,
    )
    token_inputs = (
        logprobs, *_strides_2d(logprobs),
        old_logprobs, *_strides_2d(old_logprobs),
        mask, *_strides_2d(mask),
        ref_logprobs if has_kl else None, *_strides_2d(ref_logprobs if has_kl else None),
    )
    with _device_guard(device):
        _group_kernel[(groups,)](
            rewards, rewards.stride(0),
            anchor,
            mask, *_strides_2d(mask),
            advantage, lengths, group_stats, token_count,
            group_size, width,
            float(lambda_scale),
            NORMALIZE_STD=loss_type != "dr_grpo",
            HAS_ANCHOR=anchor is not None,
            BLOCK_G=block_g,
            BLOCK_T=group_block_t,
            num_warps=4,
        )
        if loss_type == "gspo":
            _sequence_surrogate_kernel[(batch,)](
                *token_inputs,
                importance_weights, importance_weights.stride(0) if importance_weights is not None else 0,
                entropy, *_strides_2d(entropy),
                advantage, lengths,
                grad_logprobs, grad_entropy, partials,
                width,
                **scalars,
                HAS_DUAL_CLIP=dual_clip is not None,
                HAS_KL=has_kl,
                HAS_WEIGHTS=importance_weights is not None,
                HAS_ENTROPY=entropy is not None,
                BLOCK_T=block_t,
                num_warps=num_warps,
            )
        else:
            if importance_weights is None:
                weights_layout, weight_strides = _NO_WEIGHTS, (0, 0)
            elif importance_weights.dim() == 2:
                weights_layout, weight_strides = _TOKEN_WEIGHTS, _strides_2d(importance_weights)
            else:
                weights_layout, weight_strides = _RESPONSE_WEIGHTS, (importance_weights.stride(0), 0)
            _token_surrogate_kernel[(batch,)](
                *token_inputs,
                importance_weights, *weight_strides,
                entropy, *_strides_2d(entropy),
                advantage, lengths, token_count,
                grad_logprobs, grad_entropy, partials,
                width,
                **scalars,
                PER_RESPONSE_MEAN=loss_type == "grpo",
                COUNT_TOKENS=loss_type == "dapo" and loss_normalizer is None,
                HAS_DUAL_CLIP=dual_clip is not None,
                HAS_KL=has_kl,
                WEIGHTS=weights_layout,
                HAS_ENTROPY=entropy is not None,
                BLOCK_T=block_t,
                num_warps=num_warps,
            )
        _finish_kernel[(1,)](
            partials, group_stats, loss, metrics,
            batch, groups,
            BLOCK_ROWS=_FINISH_BLOCK_ROWS,
            num_warps=4,
        )
    return loss, grad_logprobs, grad_entropy, metrics
