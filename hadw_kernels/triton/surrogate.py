"""Triton kernels of ``hadw::surrogate_loss``: the policy objectives with HA-DW (docs/math.md
sections 2, 4 and 5) as ``config.LossConfig`` describes them, loss and gradient in one
launch over the tokens.

Launches, in stream order, none of which reads a value back to the host:

1. ``_lengths_kernel``, one program per response (segment): its valid-token count, and
   the call's token count (an exact int64 atomic) that ``token-mean`` divides by.
2. ``_group_kernel`` (advantages from rewards only), one program per group: mean and
   unbiased std, A_hat, Phi from the anchor (read from device memory), A = A_hat * Phi.
3. ``_surrogate_kernel``, one program per segment on grid axis 0 (2^31 - 1 programs):
   each token's contribution to the loss, d loss / d logprobs and d loss / d entropy,
   and the response's metric partial sums. A sequence ratio form first reads the
   response for its mean log-ratio (and VESPO's summed one), and the "sequence" form
   then once more for the sum of its tokens' slopes through the shared ratio.
4. ``_finish_kernel``, one program: sums the per-response partials in a fixed order
   (deterministic, unlike float atomics) into the loss and the metrics vector.

The tokens come flat, [N], in segments of one response each (``cu_seqlens``,
hadw_kernels/layout.py): a program streams its segment's tokens, so a padded [B, T] batch
(B segments of T) and a packed one run the same kernels. Advantages are per response
(from rewards) or the caller's per token.

The per-token formulas (``objective_terms``, ``policy_term``, ``kl_term``,
``aggregation_weight``) are ``token_math.py``'s, shared with the gradients-in-forward
linear kernels (``linear_logprob.py``). All arithmetic is in the compute dtype (fp32, or fp64 for fp64 log-probs); bf16 and fp16
inputs are widened on load. Offsets are int64. Masked positions are never read, so
padding may hold inf or NaN; a NaN at a valid position makes the loss NaN (maximum and
minimum propagate NaN here: Triton's default drops it). Block sizes: ``_token_launch``
and docs/triton-surrogate.md.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ..config import AGG_MODES, AGGREGATIONS, METRIC_NAMES, OBJECTIVE_NAMES, OBJECTIVES, RATIO_LEVELS
from ..precision import accumulate_dtype
from .token_math import (
    LOG_RATIO_LIMIT,
    OBJECTIVE_GMPO,
    OBJECTIVE_VESPO,
    OPTION_VESPO_K_NEG,
    OPTION_VESPO_K_POS,
    OPTION_VESPO_LAMBDA_NEG,
    OPTION_VESPO_LAMBDA_POS,
    SEQUENCE_RATIO,
    TOKEN_RATIO,
    aggregation_weight,
    clamp,
    exp_minus_one_minus_x,
    gmpo_log_ratio,
    gmpo_passes,
    kl_term,
    objective_option_values,
    objective_terms,
    option_slots,
    policy_term,
    sign,
    token_ratio,
    vespo_weight,
)

__all__ = ["surrogate_forward"]

# Columns of the per-response partial sums the surrogate kernel writes and
# _finish_kernel reduces, padded to a power of two for one aligned tile.
_LOSS = tl.constexpr(0)
_CLIP_LOW = tl.constexpr(1)
_CLIP_HIGH = tl.constexpr(2)
_RATIO_SUM = tl.constexpr(3)
_RATIO_COUNT = tl.constexpr(4)  # tokens (token ratios) or non-empty responses (sequence ratios)
_APPROX_KL = tl.constexpr(5)
_REF_KL = tl.constexpr(6)
_ENTROPY = tl.constexpr(7)
_TOKENS = tl.constexpr(8)
_NUM_PARTIALS = tl.constexpr(9)
_PARTIALS_WIDTH = tl.constexpr(16)

# Where each metric goes in the op's metrics vector (config.METRIC_NAMES).
_METRIC = {name: tl.constexpr(index) for index, name in enumerate(METRIC_NAMES)}
_M_CLIP_LOW = _METRIC["clip_frac_low"]
_M_CLIP_HIGH = _METRIC["clip_frac_high"]
_M_RATIO = _METRIC["ratio_mean"]
_M_APPROX_KL = _METRIC["approx_kl"]
_M_PHI = _METRIC["phi_mean"]
_M_ZERO_STD = _METRIC["zero_std_frac"]
_M_REF_KL = _METRIC["ref_kl"]
_M_ENTROPY = _METRIC["entropy_mean"]


# --- kernels ------------------------------------------------------------------------------


@triton.jit
def _lengths_kernel(mask_ptr, stride_mask, offsets_ptr, length_ptr, token_count_ptr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    first = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    count = tl.zeros([BLOCK_T], dtype=tl.int32)
    for start in range(first, end, BLOCK_T):
        tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
        valid = tl.load(mask_ptr + tokens * stride_mask, mask=tokens < end, other=0) != 0
        count += valid.to(tl.int32)
    length = tl.sum(count, axis=0)
    tl.store(length_ptr + row, length)
    tl.atomic_add(token_count_ptr, length.to(tl.int64))


@triton.jit
def _group_kernel(
    rewards_ptr, stride_rewards, anchor_ptr, advantage_ptr, group_stats_ptr,
    group_size, std_eps: tl.float64, lambda_scale: tl.float64,
    NORMALIZE_STD: tl.constexpr, HAS_ANCHOR: tl.constexpr, BLOCK_G: tl.constexpr,
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
        advantage_hat = centred / (std + tl.full([], std_eps, compute))
    advantage_hat = tl.where(degenerate, 0.0, advantage_hat)
    if HAS_ANCHOR:
        difficulty = mean - tl.load(anchor_ptr).to(compute)
        advantage_sign = tl.where(degenerate, 0.0, sign(centred))
        exponent = -advantage_sign * sign(difficulty) * tl.abs(difficulty)
        phi = tl.full([], lambda_scale, compute) * tl.exp(exponent)
    else:
        phi = tl.full([BLOCK_G], 1.0, compute)
    tl.store(advantage_ptr + rows, advantage_hat * phi, mask=in_group)
    tl.store(group_stats_ptr + group * 2, tl.sum(tl.where(in_group, phi, 0.0), axis=0).to(tl.float32))
    tl.store(group_stats_ptr + group * 2 + 1, degenerate.to(tl.float32))


@triton.jit
def _token_advantages(advantage_ptr, stride_advantage, row, tokens, valid, like, PER_TOKEN: tl.constexpr):
    """The tokens' advantages in ``like``'s dtype, 0 where not valid: the caller's per
    token, or the response's A_i (formed from rewards) on each of its tokens."""
    if PER_TOKEN:
        advantage = tl.load(advantage_ptr + tokens * stride_advantage, mask=valid, other=0.0).to(like.dtype)
    else:
        advantage = tl.where(valid, tl.load(advantage_ptr + row * stride_advantage).to(like.dtype), 0.0)
    return advantage


@triton.jit
def _surrogate_kernel(
    logprobs_ptr, stride_logprobs,
    old_ptr, stride_old,
    mask_ptr, stride_mask,
    ref_ptr, stride_ref,
    importance_ptr, stride_importance,
    entropy_ptr, stride_entropy,
    selected_ptr, stride_selected,
    offsets_ptr,
    advantage_ptr, stride_advantage, length_ptr, token_count_ptr,
    grad_logprobs_ptr, grad_entropy_ptr, partials_ptr,
    epsilon_low: tl.float64, epsilon_high: tl.float64,
    option_0: tl.float64, option_1: tl.float64, option_2: tl.float64, option_3: tl.float64,
    beta: tl.float64, entropy_coef: tl.float64, denominator: tl.float64,
    OBJECTIVE: tl.constexpr,
    RATIO_LEVEL: tl.constexpr,
    THROUGH_RATIO: tl.constexpr,
    PER_TOKEN_ADVANTAGES: tl.constexpr,
    PER_RESPONSE_MEAN: tl.constexpr,
    COUNT_TOKENS: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr,
    HAS_IMPORTANCE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_SELECTED: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One response: the tokens of its segment, in the ratio form RATIO_LEVEL (docs/math.md,
    section 5). The token form is local to each token. The sequence forms first read the
    response for s_i; gspo_token then gives each token the token form's gradient with
    rho = s_i, while the "sequence" form passes each token s_i / T_i times the sum over
    the response of w_i iw_t' d l / d rho (GMPO: where the token's clip passes), read in
    a second pass before any gradient is written."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    compute = grad_logprobs_ptr.dtype.element_ty
    ratio_low = tl.full([], 1.0 - epsilon_low, compute)
    ratio_high = tl.full([], 1.0 + epsilon_high, compute)
    # The clip range as it is: GMPO's is in log space, DPPO's a bound on the divergence.
    log_range_low = tl.full([], epsilon_low, compute)
    log_range_high = tl.full([], epsilon_high, compute)
    options = objective_option_values(option_0, option_1, option_2, option_3, compute)
    beta = tl.full([], beta, compute)
    entropy_coef = tl.full([], entropy_coef, compute)
    # Blocks rather than scalars for per-response values: the interpreter turns a scalar
    # boolean into float32 when broadcasting it in `&`, so (advantage < 0) must be a block.
    zeros = tl.zeros([BLOCK_T], compute)
    length = tl.load(length_ptr + row)
    length_count = tl.maximum(length, 1).to(compute)
    agg_weight = aggregation_weight(length, token_count_ptr, tl.full([], denominator, compute), PER_RESPONSE_MEAN,
                                    COUNT_TOKENS)

    approx_kl = zeros
    weight = zeros  # VESPO's phi per token, or the objective's selection
    if RATIO_LEVEL != TOKEN_RATIO:
        # s_i = exp(mean log-ratio; GMPO's clipped on the harmful side first), and VESPO's
        # sum of the tokens' clamped log-ratios.
        log_ratio_sum = zeros
        clamped_sum = zeros
        for start in range(first, end, BLOCK_T):
            tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
            valid = tl.load(mask_ptr + tokens * stride_mask, mask=tokens < end, other=0) != 0
            logprobs = tl.load(logprobs_ptr + tokens * stride_logprobs, mask=valid, other=0.0).to(compute)
            old = tl.load(old_ptr + tokens * stride_old, mask=valid, other=0.0).to(compute)
            log_ratio = logprobs - old
            clamped = clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
            approx_kl += tl.where(valid, exp_minus_one_minus_x(clamped), 0.0)
            if OBJECTIVE == OBJECTIVE_GMPO:
                advantage = _token_advantages(advantage_ptr, stride_advantage, row, tokens, valid, zeros,
                                              PER_TOKEN_ADVANTAGES)
                clipped_log_ratio = gmpo_log_ratio(log_ratio, advantage, log_range_low, log_range_high)
                log_ratio_sum += tl.where(valid, clipped_log_ratio, 0.0)
            else:
                log_ratio_sum += tl.where(valid, log_ratio, 0.0)
            if OBJECTIVE == OBJECTIVE_VESPO:
                clamped_sum += tl.where(valid, clamped, 0.0)
        ratio, ratio_passes = token_ratio(zeros + tl.sum(log_ratio_sum, axis=0) / length_count)
        if OBJECTIVE == OBJECTIVE_VESPO:
            summed_log_ratio = zeros + tl.sum(clamped_sum, axis=0)
            weight_pos = vespo_weight(summed_log_ratio, options[OPTION_VESPO_K_POS], options[OPTION_VESPO_LAMBDA_POS])
            weight_neg = vespo_weight(summed_log_ratio, options[OPTION_VESPO_K_NEG], options[OPTION_VESPO_LAMBDA_NEG])
        if RATIO_LEVEL == SEQUENCE_RATIO and THROUGH_RATIO:
            slope_sum = zeros
            for start in range(first, end, BLOCK_T):
                tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
                valid = tl.load(mask_ptr + tokens * stride_mask, mask=tokens < end, other=0) != 0
                advantage = _token_advantages(advantage_ptr, stride_advantage, row, tokens, valid, zeros,
                                              PER_TOKEN_ADVANTAGES)
                _, d_ratio, _ = objective_terms(ratio, advantage, zeros, zeros, weight, ratio_low, ratio_high,
                                                log_range_low, log_range_high, options, OBJECTIVE)
                if HAS_IMPORTANCE:
                    d_ratio *= tl.load(importance_ptr + tokens * stride_importance, mask=valid, other=0.0).to(compute)
                slope_sum += tl.where(valid, d_ratio, 0.0)
            # d s_i / d logp_t = s_i / T_i where the mean's clamp passes (w_i comes at the store).
            ratio_share = tl.where(ratio_passes, (zeros + tl.sum(slope_sum, axis=0)) * ratio / length_count, 0.0)

    objective_sum = zeros
    advantage_sum = zeros
    clip_low = zeros
    clip_high = zeros
    ratio_sum = zeros
    ref_kl = zeros
    entropy_sum = zeros
    for start in range(first, end, BLOCK_T):
        tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
        inside = tokens < end
        valid = tl.load(mask_ptr + tokens * stride_mask, mask=inside, other=0) != 0
        advantage = _token_advantages(advantage_ptr, stride_advantage, row, tokens, valid, zeros,
                                      PER_TOKEN_ADVANTAGES)
        if RATIO_LEVEL != TOKEN_RATIO:
            advantage_sum += advantage  # the sign of the response's, for its clip fractions
        # The log-probs are read (again) where this token's terms need them: its own ratio,
        # the KL, an objective that weighs the log-prob, GMPO's clip of its log-ratio.
        if RATIO_LEVEL == TOKEN_RATIO or HAS_KL or not THROUGH_RATIO or OBJECTIVE == OBJECTIVE_GMPO:
            logprobs = tl.load(logprobs_ptr + tokens * stride_logprobs, mask=valid, other=0.0).to(compute)
        else:
            logprobs = zeros
        old = logprobs  # read below where a term needs it: every objective that does takes token ratios
        if RATIO_LEVEL == TOKEN_RATIO or OBJECTIVE == OBJECTIVE_GMPO:
            old = tl.load(old_ptr + tokens * stride_old, mask=valid, other=0.0).to(compute)
            log_ratio = logprobs - old
        if RATIO_LEVEL == TOKEN_RATIO:
            ratio, ratio_passes = token_ratio(log_ratio)
            approx_kl += tl.where(valid, exp_minus_one_minus_x(clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)),
                                  0.0)
            clip_low += (valid & (ratio < ratio_low) & (advantage < 0)).to(compute)
            clip_high += (valid & (ratio > ratio_high) & (advantage > 0)).to(compute)
            ratio_sum += tl.where(valid, ratio, 0.0)
        if OBJECTIVE == OBJECTIVE_VESPO:
            weight = tl.where(advantage >= 0, weight_pos, weight_neg)
        if HAS_SELECTED:
            weight = (tl.load(selected_ptr + tokens * stride_selected, mask=valid, other=0) != 0).to(compute)
        if RATIO_LEVEL == SEQUENCE_RATIO:
            # The ratio's share comes from the whole response (ratio_share, below).
            objective, _, grad = objective_terms(ratio, advantage, logprobs, old, weight, ratio_low, ratio_high,
                                                 log_range_low, log_range_high, options, OBJECTIVE)
        else:
            objective, grad = policy_term(ratio, ratio_passes, advantage, logprobs, old, weight, ratio_low, ratio_high,
                                          log_range_low, log_range_high, options, OBJECTIVE)
        if HAS_IMPORTANCE:
            token_importance = tl.load(importance_ptr + tokens * stride_importance, mask=valid, other=0.0).to(compute)
            objective *= token_importance
            grad *= token_importance
        if RATIO_LEVEL == SEQUENCE_RATIO and THROUGH_RATIO:
            if OBJECTIVE == OBJECTIVE_GMPO:
                grad += tl.where(gmpo_passes(log_ratio, advantage, log_range_low, log_range_high), ratio_share, 0.0)
            else:
                grad += ratio_share
        if HAS_KL:
            ref = tl.load(ref_ptr + tokens * stride_ref, mask=valid, other=0.0).to(compute)
            kl, kl_slope = kl_term(logprobs, ref, KL_ESTIMATOR)
            objective += beta * kl
            grad += beta * kl_slope
            ref_kl += tl.where(valid, kl, 0.0)
        if HAS_ENTROPY:
            entropy = tl.load(entropy_ptr + tokens * stride_entropy, mask=valid, other=0.0).to(compute)
            objective -= entropy_coef * entropy
            entropy_sum += tl.where(valid, entropy, 0.0)
            tl.store(grad_entropy_ptr + tokens, tl.where(valid, -entropy_coef * agg_weight, 0.0), mask=inside)
        tl.store(grad_logprobs_ptr + tokens, tl.where(valid, grad * agg_weight, 0.0), mask=inside)
        objective_sum += tl.where(valid, objective, 0.0)

    partials = partials_ptr + row * _PARTIALS_WIDTH
    token_total = length.to(compute)
    tl.store(partials + _LOSS, tl.sum(objective_sum, axis=0) * agg_weight)
    if RATIO_LEVEL == TOKEN_RATIO:
        tl.store(partials + _CLIP_LOW, tl.sum(clip_low, axis=0))
        tl.store(partials + _CLIP_HIGH, tl.sum(clip_high, axis=0))
        tl.store(partials + _RATIO_SUM, tl.sum(ratio_sum, axis=0))
        tl.store(partials + _RATIO_COUNT, token_total)
    else:
        # One ratio per non-empty response: clip fractions and the mean ratio count
        # responses, with the sign of the sum of the response's token advantages (its A_i
        # times T_i when the advantages come from rewards).
        response_advantage = zeros + tl.sum(advantage_sum, axis=0)
        has_tokens = length > 0
        lead = tl.arange(0, BLOCK_T) == 0
        tl.store(partials + _CLIP_LOW,
                 tl.sum(tl.where(lead & has_tokens & (ratio < ratio_low) & (response_advantage < 0), 1.0, 0.0),
                        axis=0).to(compute))
        tl.store(partials + _CLIP_HIGH,
                 tl.sum(tl.where(lead & has_tokens & (ratio > ratio_high) & (response_advantage > 0), 1.0, 0.0),
                        axis=0).to(compute))
        tl.store(partials + _RATIO_SUM, tl.sum(tl.where(lead & has_tokens, ratio, 0.0), axis=0))
        tl.store(partials + _RATIO_COUNT, has_tokens.to(compute))
    tl.store(partials + _APPROX_KL, tl.sum(approx_kl, axis=0))
    tl.store(partials + _REF_KL, tl.sum(ref_kl, axis=0))
    tl.store(partials + _ENTROPY, tl.sum(entropy_sum, axis=0))
    tl.store(partials + _TOKENS, token_total)


@triton.jit
def _pick(totals, columns, index: tl.constexpr):
    return tl.sum(tl.where(columns == index, totals, 0.0), axis=0)


@triton.jit
def _finish_kernel(
    partials_ptr, group_stats_ptr, loss_ptr, metrics_ptr,
    batch, groups,
    HAS_GROUPS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
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

    tl.store(loss_ptr, _pick(totals, columns, _LOSS).to(loss_ptr.dtype.element_ty))
    ratio_count = tl.maximum(_pick(totals, columns, _RATIO_COUNT), 1.0)
    token_count = tl.maximum(_pick(totals, columns, _TOKENS), 1.0)
    tl.store(metrics_ptr + _M_CLIP_LOW, (_pick(totals, columns, _CLIP_LOW) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + _M_CLIP_HIGH, (_pick(totals, columns, _CLIP_HIGH) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + _M_RATIO, (_pick(totals, columns, _RATIO_SUM) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + _M_APPROX_KL, (_pick(totals, columns, _APPROX_KL) / token_count).to(tl.float32))
    tl.store(metrics_ptr + _M_REF_KL, (_pick(totals, columns, _REF_KL) / token_count).to(tl.float32))
    tl.store(metrics_ptr + _M_ENTROPY, (_pick(totals, columns, _ENTROPY) / token_count).to(tl.float32))
    phi_mean = tl.zeros([], tl.float64)
    zero_std_frac = tl.zeros([], tl.float64)
    if HAS_GROUPS:
        group_columns = tl.arange(0, 2)
        group_sums = tl.zeros([BLOCK_ROWS, 2], tl.float64)
        for start in range(0, groups, BLOCK_ROWS):
            rows = start + tl.arange(0, BLOCK_ROWS).to(tl.int64)
            tile = tl.load(group_stats_ptr + rows[:, None] * 2 + group_columns[None, :], mask=(rows < groups)[:, None],
                           other=0.0)
            group_sums += tile.to(tl.float64)
        group_totals = tl.sum(group_sums, axis=0)
        phi_mean = _pick(group_totals, group_columns, 0) / tl.maximum(batch, 1)
        zero_std_frac = _pick(group_totals, group_columns, 1) / tl.maximum(groups, 1)
    tl.store(metrics_ptr + _M_PHI, phi_mean.to(tl.float32))
    tl.store(metrics_ptr + _M_ZERO_STD, zero_std_frac.to(tl.float32))


# --- launch configuration -----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _compute_capability(device: torch.device) -> tuple[int, int]:
    # A host-side property query: no device synchronisation.
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _token_launch(width: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_T, num_warps) for the per-response kernels (docs/triton-surrogate.md), for
    segments of ``width`` tokens on average (a padded batch's: its width).

    One program streams one response. Hopper (sm_90) needs about twice Ampere's bytes
    in flight per SM to cover its bandwidth, so its tile is twice as wide. Four tokens
    a thread keep an fp32 load one 16-byte vector.
    """
    widest = 2048 if _compute_capability(device) >= (9, 0) else 1024
    block = min(triton.next_power_of_2(max(width, 1)), widest)
    return block, max(1, min(16, block // 128))


_FINISH_BLOCK_ROWS = 256


def device_guard(device: torch.device):
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def aggregation(
    loss_agg_mode: int, loss_normalizer: float | None, max_response_length: int | None, segments: int
) -> tuple[float, bool, bool]:
    """(denominator, PER_RESPONSE_MEAN, COUNT_TOKENS) of ``aggregation_weight`` for an
    aggregation mode, from its row of config.AGGREGATIONS (aggregation.agg_weights).
    The constant L of ``times_max_length`` arrives resolved (the losses default it to a
    padded batch's width)."""
    rule = AGGREGATIONS[AGG_MODES[loss_agg_mode]]
    count_tokens = rule.count == "tokens" and loss_normalizer is None
    if count_tokens and (rule.per_response_mean or rule.times_max_length):
        # aggregation_weight's device count stands alone: teach it the other factors first.
        raise NotImplementedError(f"the Triton surrogate cannot weigh {AGG_MODES[loss_agg_mode]!r} yet")
    if rule.count == "responses":
        denominator = loss_normalizer or float(max(segments, 1))
    else:  # "tokens" (counted on the device unless normalised) or "one"
        denominator = loss_normalizer or 1.0
    if rule.times_max_length:
        if max_response_length is None:
            raise ValueError(f"loss_agg_mode {AGG_MODES[loss_agg_mode]!r} needs max_response_length")
        denominator *= float(max_response_length)
    return denominator, rule.per_response_mean, count_tokens


# --- the op's implementation ----------------------------------------------------------------


def objective_arguments(objective, epsilon_low, epsilon_high, objective_options) -> dict:
    """The kernels' arguments for the op's objective: its code, the clip range and its
    option vector as fp64 scalars."""
    return dict(epsilon_low=float(epsilon_low), epsilon_high=float(epsilon_high), **option_slots(objective_options),
                OBJECTIVE=objective)


def surrogate_forward(
    logprobs, old_logprobs, response_mask, cu_seqlens, rewards, advantages, response_advantages, anchor, ref_logprobs,
    importance_weights, entropy, selected, group_size, normalize_std, std_eps, lambda_scale, loss_agg_mode,
    ratio_level, objective, epsilon_low, epsilon_high, objective_options, beta, kl_estimator, entropy_coef,
    loss_normalizer, max_response_length,
):
    """``hadw::surrogate_loss`` (schema in ``ops.schemas``): the loss, its gradient with
    respect to the log-probs and the entropy, and the metrics in METRIC_NAMES order.

    Inputs are assumed validated (``validation``): per-token tensors [N] in the segments
    of ``cu_seqlens`` [S+1], rewards [S] or the caller's advantages, per token [N] or
    per response [S]. Only shapes and
    Python scalars steer the launches; no tensor value reaches the host.
    """
    name = OBJECTIVE_NAMES[objective]
    if RATIO_LEVELS[ratio_level] not in OBJECTIVES[name].ratio_levels:
        # LossConfig refuses it too; the kernel has no such variant (VESPO's weight, for one,
        # is formed per response).
        raise ValueError(f"objective {name!r} takes ratio_level in {OBJECTIVES[name].ratio_levels}, got "
                         f"{RATIO_LEVELS[ratio_level]!r}")
    (tokens,) = logprobs.shape
    segments = cu_seqlens.shape[0] - 1
    device = logprobs.device
    compute = accumulate_dtype(logprobs.dtype)
    # The kernels write every element of the outputs (without segments, there are none
    # but the loss and the metrics, zeros): no fill launches before them.
    allocate = torch.zeros if segments == 0 else torch.empty
    grad_logprobs = allocate((tokens,), dtype=compute, device=device)
    grad_entropy = allocate((tokens,) if entropy is not None else (0,), dtype=compute, device=device)
    loss = allocate((), dtype=compute, device=device)
    metrics = allocate(len(METRIC_NAMES), dtype=torch.float32, device=device)
    has_groups = rewards is not None
    per_token_advantages = advantages is not None
    groups = segments // group_size if has_groups else 0
    group_stats = torch.empty((max(groups, 1), 2), dtype=torch.float32, device=device)
    if has_groups:
        # At least the compute dtype: float64 log-probs with float32 rewards get float64 advantages.
        advantages = torch.empty(segments, dtype=torch.promote_types(rewards.dtype, compute), device=device)
    elif not per_token_advantages:
        advantages = response_advantages
    if segments == 0:
        return loss, grad_logprobs, grad_entropy, metrics

    # bool storage read as bytes: one byte per token, and any dtype works through `!= 0`.
    mask = response_mask.view(torch.uint8) if response_mask.dtype == torch.bool else response_mask
    selected_bytes = selected.view(torch.uint8) if selected is not None and selected.dtype == torch.bool else selected
    offsets = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    denominator, per_response_mean, count_tokens = aggregation(
        loss_agg_mode, loss_normalizer, max_response_length, segments
    )
    has_kl = beta > 0
    lengths = torch.empty(segments, dtype=torch.int32, device=device)
    token_count = torch.zeros((), dtype=torch.int64, device=device)
    partials = torch.empty((segments, _PARTIALS_WIDTH.value), dtype=compute, device=device)
    block_t, num_warps = _token_launch(-(-tokens // max(segments, 1)), device)

    def stride(tensor):
        return 0 if tensor is None else tensor.stride(0)

    with device_guard(device):
        _lengths_kernel[(segments,)](
            mask, stride(mask), offsets, lengths, token_count, BLOCK_T=block_t, num_warps=num_warps,
        )
        if has_groups:
            _group_kernel[(groups,)](
                rewards, rewards.stride(0), anchor, advantages, group_stats,
                group_size, float(std_eps), float(lambda_scale),
                NORMALIZE_STD=normalize_std, HAS_ANCHOR=anchor is not None,
                BLOCK_G=triton.next_power_of_2(group_size), num_warps=4,
            )
        _surrogate_kernel[(segments,)](
            logprobs, stride(logprobs),
            old_logprobs, stride(old_logprobs),
            mask, stride(mask),
            ref_logprobs if has_kl else None, stride(ref_logprobs if has_kl else None),
            importance_weights, stride(importance_weights),
            entropy, stride(entropy),
            selected_bytes, stride(selected_bytes),
            offsets,
            advantages, advantages.stride(0), lengths, token_count,
            grad_logprobs, grad_entropy, partials,
            **objective_arguments(objective, epsilon_low, epsilon_high, objective_options),
            beta=float(beta),
            entropy_coef=float(entropy_coef),
            denominator=float(denominator),
            RATIO_LEVEL=ratio_level,
            THROUGH_RATIO=OBJECTIVES[name].through_ratio,
            PER_TOKEN_ADVANTAGES=per_token_advantages,
            PER_RESPONSE_MEAN=per_response_mean,
            COUNT_TOKENS=count_tokens,
            HAS_KL=has_kl,
            KL_ESTIMATOR=kl_estimator,
            HAS_IMPORTANCE=importance_weights is not None,
            HAS_ENTROPY=entropy is not None,
            HAS_SELECTED=selected is not None,
            BLOCK_T=block_t,
            num_warps=num_warps,
        )
        _finish_kernel[(1,)](
            partials, group_stats, loss, metrics,
            segments, groups,
            HAS_GROUPS=has_groups, BLOCK_ROWS=_FINISH_BLOCK_ROWS, num_warps=4,
        )
    return loss, grad_logprobs, grad_entropy, metrics
