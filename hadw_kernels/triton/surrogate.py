"""The Triton kernel of ``hadw::surrogate_loss``: the policy objectives with HA-DW (docs/math.md
sections 2, 4 and 5) as ``config.LossConfig`` describes them, loss, gradient and metrics in
one launch over the tokens, which reads no value back to the host.

``_surrogate_kernel`` runs one program per response (segment) on grid axis 0 (2^31 - 1
programs). A program forms what its response needs from its group and itself: with
rewards, its advantage A = A_hat * Phi by the call's estimator (``advantage.py``; James-
Stein without the caller's batch totals first has them reduced over the call's groups, one
launch more); its valid-token count T_i
(counted first where seq-mean-token-mean divides by it); then each token's contribution to
the loss, d loss / d logprobs and d loss / d entropy, and the response's metric partial sums.
A sequence ratio form first reads the response for its mean log-ratio (and, by the
objective's response step, its summed one), and the "sequence" form then once more for the
sum of its tokens' slopes through the shared ratio. The program that arrives last (an
atomic count of arrivals) sums every response's partials in a fixed order, in float64,
into the loss and the metrics: as deterministic as a launch of its own, without one.

The one figure no program has before its tokens is token-mean's count of the batch's valid
tokens: the gradient is written without its 1 / N_tok, which the last program forms and
writes as ``grad_scale`` for backward to apply with the upstream gradient (the op's
contract, ops/schemas.py), and divides the loss by.

The tokens come flat, [N], in segments of one response each (``cu_seqlens``,
hadw_kernels/batch/token_layout.py): a program streams its segment's tokens, so a padded [B, T] batch
(B segments of T) and a packed one run the same kernel. Advantages are per response
(from rewards or the caller's) or the caller's per token.

The per-token formulas (``objective_terms``, ``policy_term``, ``kl_term``,
``aggregation_weight``) are ``token_math.py``'s, shared with the gradients-in-forward
linear kernels (``linear_logprob.py``). All arithmetic is in the compute dtype (fp32, or fp64 for fp64 log-probs); bf16 and fp16
inputs are widened on load. Offsets are int64. Masked positions are never read, so
padding may hold inf or NaN; a NaN at a valid position makes the loss NaN (maximum and
minimum propagate NaN here: Triton's default drops it). Block sizes: ``_token_launch``
and docs/architecture.md ("The Triton surrogate kernel"); launches: ``launch.BoundKernel``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ..objectives.table import OBJECTIVE_NAMES, OBJECTIVES, RATIO_LEVELS, RESPONSE_STEPS
from ..tables.aggregations import AGG_MODES, AGGREGATIONS, counts_batch_tokens
from ..tables.estimators import ESTIMATOR_NAMES, ESTIMATORS, SCOPES
from ..tables.metrics import METRIC_NAMES
from ..tables.precision import accumulate_dtype
from .advantage import call_totals, group_advantage_terms
from .codes import RESPONSE_STEP_CLIPPED_LOG_RATIO_MEAN, RESPONSE_STEP_LOG_RATIO_SUM
from .launch import bound_kernel
from .token_math import (
    LOG_RATIO_LIMIT,
    SEQUENCE_RATIO,
    TOKEN_RATIO,
    aggregation_weight,
    clamp,
    exp_minus_one_minus_x,
    kl_term,
    objective_option_values,
    objective_terms,
    option_slots,
    policy_term,
    response_log_ratio,
    response_weights,
    token_ratio,
)

__all__ = ["surrogate_forward"]

# Columns of the per-response partial sums the programs write and the last one reduces,
# padded to a power of two for one aligned tile.
_LOSS = tl.constexpr(0)
_CLIP_LOW = tl.constexpr(1)
_CLIP_HIGH = tl.constexpr(2)
_RATIO_SUM = tl.constexpr(3)
_RATIO_COUNT = tl.constexpr(4)  # tokens (token ratios) or non-empty responses (sequence ratios)
_APPROX_KL = tl.constexpr(5)
_REF_KL = tl.constexpr(6)
_ENTROPY = tl.constexpr(7)
_TOKENS = tl.constexpr(8)
_PHI = tl.constexpr(9)  # the response's Phi (1 without an anchor)
_DEGENERATE = tl.constexpr(10)  # 1 on the first response of a group whose rewards are all equal
_NUM_PARTIALS = tl.constexpr(11)
_PARTIALS_WIDTH = tl.constexpr(16)

# Where each metric goes in the op's metrics vector (metrics.METRIC_NAMES).
_METRIC = {name: tl.constexpr(index) for index, name in enumerate(METRIC_NAMES)}
_M_CLIP_LOW = _METRIC["clip_frac_low"]
_M_CLIP_HIGH = _METRIC["clip_frac_high"]
_M_RATIO = _METRIC["ratio_mean"]
_M_APPROX_KL = _METRIC["approx_kl"]
_M_PHI = _METRIC["phi_mean"]
_M_ZERO_STD = _METRIC["zero_std_frac"]
_M_REF_KL = _METRIC["ref_kl"]
_M_ENTROPY = _METRIC["entropy_mean"]


# --- kernel -------------------------------------------------------------------------------


@triton.jit
def _token_advantages(advantage_ptr, stride_advantage, response_advantage, tokens, valid, like,
                      PER_TOKEN: tl.constexpr):
    """The tokens' advantages in ``like``'s dtype, 0 where not valid: the caller's per
    token, or the response's A_i on each of its tokens."""
    if PER_TOKEN:
        advantage = tl.load(advantage_ptr + tokens * stride_advantage, mask=valid, other=0.0).to(like.dtype)
    else:
        advantage = tl.where(valid, response_advantage, 0.0)
    return advantage


@triton.jit
def _valid_tokens(mask_ptr, stride_mask, first, end, BLOCK_T: tl.constexpr):
    """T_i: the valid tokens of the segment [first, end)."""
    count = tl.zeros([BLOCK_T], dtype=tl.int32)
    for start in range(first, end, BLOCK_T):
        tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
        count += (tl.load(mask_ptr + tokens * stride_mask, mask=tokens < end, other=0) != 0).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def _pick(totals, columns, index: tl.constexpr):
    return tl.sum(tl.where(columns == index, totals, 0.0), axis=0)


@triton.jit
def _finish(partials_ptr, loss_ptr, metrics_ptr, grad_scale_ptr, segments, group_size,
            HAS_GROUPS: tl.constexpr, COUNT_TOKENS: tl.constexpr, FINISH_ROWS: tl.constexpr):
    """The loss and the metrics from every response's partials, summed in a fixed order in
    float64: the result does not depend on scheduling and the counts stay exact beyond
    2^24 tokens. Under token-mean without a normaliser, the loss's division by the batch's
    valid tokens and the gradient's factor (``grad_scale``). The partials are read through
    L2 (``.cg``): other programs wrote them, after this one's L1 may have cached lines."""
    columns = tl.arange(0, _PARTIALS_WIDTH)
    totals = tl.zeros([_PARTIALS_WIDTH], tl.float64)
    for start in range(0, segments, FINISH_ROWS):
        rows = start + tl.arange(0, FINISH_ROWS).to(tl.int64)
        tile_mask = (rows < segments)[:, None] & (columns < _NUM_PARTIALS)[None, :]
        tile = tl.load(partials_ptr + rows[:, None] * _PARTIALS_WIDTH + columns[None, :], mask=tile_mask, other=0.0,
                       cache_modifier=".cg")
        totals += tl.sum(tile.to(tl.float64), axis=0)

    loss = _pick(totals, columns, _LOSS)
    ratio_count = tl.maximum(_pick(totals, columns, _RATIO_COUNT), 1.0)
    token_count = tl.maximum(_pick(totals, columns, _TOKENS), 1.0)
    if COUNT_TOKENS:
        loss = loss / token_count
        tl.store(grad_scale_ptr, (1.0 / token_count).to(grad_scale_ptr.dtype.element_ty))
    tl.store(loss_ptr, loss.to(loss_ptr.dtype.element_ty))
    tl.store(metrics_ptr + _M_CLIP_LOW, (_pick(totals, columns, _CLIP_LOW) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + _M_CLIP_HIGH, (_pick(totals, columns, _CLIP_HIGH) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + _M_RATIO, (_pick(totals, columns, _RATIO_SUM) / ratio_count).to(tl.float32))
    tl.store(metrics_ptr + _M_APPROX_KL, (_pick(totals, columns, _APPROX_KL) / token_count).to(tl.float32))
    tl.store(metrics_ptr + _M_REF_KL, (_pick(totals, columns, _REF_KL) / token_count).to(tl.float32))
    tl.store(metrics_ptr + _M_ENTROPY, (_pick(totals, columns, _ENTROPY) / token_count).to(tl.float32))
    phi_mean = tl.zeros([], tl.float64)
    zero_std_frac = tl.zeros([], tl.float64)
    if HAS_GROUPS:
        phi_mean = _pick(totals, columns, _PHI) / tl.maximum(segments, 1)
        zero_std_frac = _pick(totals, columns, _DEGENERATE) / tl.maximum(segments // group_size, 1)
    tl.store(metrics_ptr + _M_PHI, phi_mean.to(tl.float32))
    tl.store(metrics_ptr + _M_ZERO_STD, zero_std_frac.to(tl.float32))


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
    rewards_ptr, stride_rewards, anchor_ptr,
    totals_ptr, prior_ptr, stride_prior_row, stride_prior_column,
    advantage_ptr, stride_advantage,
    grad_logprobs_ptr, grad_entropy_ptr, partials_ptr, arrivals_ptr,
    loss_ptr, metrics_ptr, grad_scale_ptr,
    segments, denominator: tl.float64,
    group_size, std_eps: tl.float64, lambda_scale: tl.float64,
    epsilon_low: tl.float64, epsilon_high: tl.float64,
    option_0: tl.float64, option_1: tl.float64, option_2: tl.float64, option_3: tl.float64,
    beta: tl.float64, entropy_coef: tl.float64,
    OBJECTIVE: tl.constexpr,
    RESPONSE_STEP: tl.constexpr,
    RATIO_LEVEL: tl.constexpr,
    THROUGH_RATIO: tl.constexpr,
    HAS_GROUPS: tl.constexpr,
    NORMALIZE_STD: tl.constexpr,
    HAS_ANCHOR: tl.constexpr,
    SCOPE: tl.constexpr,
    LEAVE_ONE_OUT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PER_TOKEN_ADVANTAGES: tl.constexpr,
    PER_RESPONSE_MEAN: tl.constexpr,
    COUNT_TOKENS: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr,
    HAS_IMPORTANCE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_SELECTED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FINISH_ROWS: tl.constexpr,
):
    """One response: its advantage, then the tokens of its segment in the ratio form
    RATIO_LEVEL (docs/math.md, section 5); the last program to finish, the loss and the
    metrics. The token form is local to each token. The sequence forms first read the
    response for s_i; gspo_token then gives each token the token form's gradient with
    rho = s_i, while the "sequence" form passes each token s_i / T_i times the sum over
    the response of w_i iw_t' d l / d rho (where the token's clip passes, under the
    response step clipped_log_ratio_mean), read in a second pass before any gradient is
    written. RESPONSE_STEP is the objective's (objectives.table.RESPONSE_STEPS)."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    compute = grad_logprobs_ptr.dtype.element_ty
    ratio_low = tl.full([], 1.0 - epsilon_low, compute)
    ratio_high = tl.full([], 1.0 + epsilon_high, compute)
    # The clip range as it is: a clipped_log_ratio_mean step's is in log space, DPPO's a
    # bound on the divergence.
    log_range_low = tl.full([], epsilon_low, compute)
    log_range_high = tl.full([], epsilon_high, compute)
    options = objective_option_values(option_0, option_1, option_2, option_3, compute)
    beta = tl.full([], beta, compute)
    entropy_coef = tl.full([], entropy_coef, compute)
    # Blocks rather than scalars for per-response values: the interpreter turns a scalar
    # boolean into float32 when broadcasting it in `&`, so (advantage < 0) must be a block.
    zeros = tl.zeros([BLOCK_T], compute)

    # The response's advantage: from its group's rewards (in their dtype promoted with the
    # compute dtype, as a float64 reward keeps its digits), or the caller's.
    response_advantage = tl.zeros([], compute)
    phi = tl.full([], 1.0, compute)
    degenerate = tl.zeros([], compute)
    if HAS_GROUPS:
        group_dtype = tl.float64 if (rewards_ptr.dtype.element_ty == tl.float64) or (compute == tl.float64) \
            else tl.float32
        group_advantage, group_phi, group_degenerate = group_advantage_terms(
            rewards_ptr, stride_rewards, anchor_ptr, totals_ptr, prior_ptr, stride_prior_row, stride_prior_column,
            row, group_size, std_eps, lambda_scale, group_dtype, NORMALIZE_STD, HAS_ANCHOR, SCOPE, LEAVE_ONE_OUT,
            BLOCK_G)
        response_advantage = group_advantage.to(compute)
        phi = group_phi.to(compute)
        degenerate = tl.where(group_degenerate & (row % group_size == 0), 1.0, 0.0).to(compute)
    elif not PER_TOKEN_ADVANTAGES:
        response_advantage = tl.load(advantage_ptr + row * stride_advantage).to(compute)

    # T_i before the tokens where the aggregation weight needs it (a sequence form counts
    # in its first pass, below).
    if (RATIO_LEVEL == TOKEN_RATIO) and PER_RESPONSE_MEAN:
        length = _valid_tokens(mask_ptr, stride_mask, first, end, BLOCK_T)
    else:
        length = tl.zeros([], tl.int32)

    approx_kl = zeros
    weight = zeros  # the response step's weight per token (VESPO's phi), or the selection
    if RATIO_LEVEL != TOKEN_RATIO:
        # s_i = exp(mean log-ratio, each through the objective's clip first under
        # clipped_log_ratio_mean), and under log_ratio_sum the sum of the tokens' clamped
        # log-ratios.
        log_ratio_sum = zeros
        clamped_sum = zeros
        count = tl.zeros([BLOCK_T], dtype=tl.int32)
        for start in range(first, end, BLOCK_T):
            tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
            valid = tl.load(mask_ptr + tokens * stride_mask, mask=tokens < end, other=0) != 0
            count += valid.to(tl.int32)
            logprobs = tl.load(logprobs_ptr + tokens * stride_logprobs, mask=valid, other=0.0).to(compute)
            old = tl.load(old_ptr + tokens * stride_old, mask=valid, other=0.0).to(compute)
            log_ratio = logprobs - old
            clamped = clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
            approx_kl += tl.where(valid, exp_minus_one_minus_x(clamped), 0.0)
            if RESPONSE_STEP == RESPONSE_STEP_CLIPPED_LOG_RATIO_MEAN:
                advantage = _token_advantages(advantage_ptr, stride_advantage, response_advantage, tokens, valid, zeros,
                                              PER_TOKEN_ADVANTAGES)
                clipped_log_ratio, _ = response_log_ratio(log_ratio, advantage, log_range_low, log_range_high,
                                                          OBJECTIVE)
                log_ratio_sum += tl.where(valid, clipped_log_ratio, 0.0)
            else:
                log_ratio_sum += tl.where(valid, log_ratio, 0.0)
            if RESPONSE_STEP == RESPONSE_STEP_LOG_RATIO_SUM:
                clamped_sum += tl.where(valid, clamped, 0.0)
        length = tl.sum(count, axis=0)
        length_count = tl.maximum(length, 1).to(compute)
        ratio, ratio_passes = token_ratio(zeros + tl.sum(log_ratio_sum, axis=0) / length_count)
        if RESPONSE_STEP == RESPONSE_STEP_LOG_RATIO_SUM:
            weight_nonnegative, weight_negative = response_weights(zeros + tl.sum(clamped_sum, axis=0), options,
                                                                   OBJECTIVE)
        if RATIO_LEVEL == SEQUENCE_RATIO and THROUGH_RATIO:
            slope_sum = zeros
            for start in range(first, end, BLOCK_T):
                tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
                valid = tl.load(mask_ptr + tokens * stride_mask, mask=tokens < end, other=0) != 0
                advantage = _token_advantages(advantage_ptr, stride_advantage, response_advantage, tokens, valid, zeros,
                                              PER_TOKEN_ADVANTAGES)
                slope_weight = weight
                if RESPONSE_STEP == RESPONSE_STEP_LOG_RATIO_SUM:
                    slope_weight = tl.where(advantage >= 0, weight_nonnegative, weight_negative)
                _, d_ratio, _ = objective_terms(ratio, advantage, zeros, zeros, slope_weight, ratio_low, ratio_high,
                                                log_range_low, log_range_high, options, OBJECTIVE)
                if HAS_IMPORTANCE:
                    d_ratio *= tl.load(importance_ptr + tokens * stride_importance, mask=valid, other=0.0).to(compute)
                slope_sum += tl.where(valid, d_ratio, 0.0)
            # d s_i / d logp_t = s_i / T_i where the mean's clamp passes (w_i comes at the store).
            ratio_share = tl.where(ratio_passes, (zeros + tl.sum(slope_sum, axis=0)) * ratio / length_count, 0.0)
    # w_i; token-mean's 1 / N_tok is the gradient's grad_scale (the module's docstring).
    agg_weight = aggregation_weight(length, tl.full([], denominator, compute), PER_RESPONSE_MEAN)

    objective_sum = zeros
    advantage_sum = zeros
    clip_low = zeros
    clip_high = zeros
    ratio_sum = zeros
    ref_kl = zeros
    entropy_sum = zeros
    token_count = tl.zeros([BLOCK_T], dtype=tl.int32)
    for start in range(first, end, BLOCK_T):
        tokens = start + tl.arange(0, BLOCK_T).to(tl.int64)
        inside = tokens < end
        valid = tl.load(mask_ptr + tokens * stride_mask, mask=inside, other=0) != 0
        token_count += valid.to(tl.int32)
        advantage = _token_advantages(advantage_ptr, stride_advantage, response_advantage, tokens, valid, zeros,
                                      PER_TOKEN_ADVANTAGES)
        if RATIO_LEVEL != TOKEN_RATIO:
            advantage_sum += advantage  # the sign of the response's, for its clip fractions
        # The log-probs are read (again) where this token's terms need them: its own ratio,
        # the KL, an objective that weighs the log-prob, the clip of its log-ratio under
        # clipped_log_ratio_mean.
        if (RATIO_LEVEL == TOKEN_RATIO or HAS_KL or not THROUGH_RATIO
                or RESPONSE_STEP == RESPONSE_STEP_CLIPPED_LOG_RATIO_MEAN):
            logprobs = tl.load(logprobs_ptr + tokens * stride_logprobs, mask=valid, other=0.0).to(compute)
        else:
            logprobs = zeros
        old = logprobs  # read below where a term needs it: every objective that does takes token ratios
        if RATIO_LEVEL == TOKEN_RATIO or RESPONSE_STEP == RESPONSE_STEP_CLIPPED_LOG_RATIO_MEAN:
            old = tl.load(old_ptr + tokens * stride_old, mask=valid, other=0.0).to(compute)
            log_ratio = logprobs - old
        if RATIO_LEVEL == TOKEN_RATIO:
            ratio, ratio_passes = token_ratio(log_ratio)
            approx_kl += tl.where(valid, exp_minus_one_minus_x(clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)),
                                  0.0)
            clip_low += (valid & (ratio < ratio_low) & (advantage < 0)).to(compute)
            clip_high += (valid & (ratio > ratio_high) & (advantage > 0)).to(compute)
            ratio_sum += tl.where(valid, ratio, 0.0)
        if RESPONSE_STEP == RESPONSE_STEP_LOG_RATIO_SUM:
            weight = tl.where(advantage >= 0, weight_nonnegative, weight_negative)
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
            if RESPONSE_STEP == RESPONSE_STEP_CLIPPED_LOG_RATIO_MEAN:
                _, passes = response_log_ratio(log_ratio, advantage, log_range_low, log_range_high, OBJECTIVE)
                grad += tl.where(passes, ratio_share, 0.0)
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
    if (RATIO_LEVEL == TOKEN_RATIO) and not PER_RESPONSE_MEAN:
        length = tl.sum(token_count, axis=0)

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
        # times T_i when the advantages are per response).
        response_sum = zeros + tl.sum(advantage_sum, axis=0)
        has_tokens = length > 0
        lead = tl.arange(0, BLOCK_T) == 0
        tl.store(partials + _CLIP_LOW,
                 tl.sum(tl.where(lead & has_tokens & (ratio < ratio_low) & (response_sum < 0), 1.0, 0.0),
                        axis=0).to(compute))
        tl.store(partials + _CLIP_HIGH,
                 tl.sum(tl.where(lead & has_tokens & (ratio > ratio_high) & (response_sum > 0), 1.0, 0.0),
                        axis=0).to(compute))
        tl.store(partials + _RATIO_SUM, tl.sum(tl.where(lead & has_tokens, ratio, 0.0), axis=0))
        tl.store(partials + _RATIO_COUNT, has_tokens.to(compute))
    tl.store(partials + _APPROX_KL, tl.sum(approx_kl, axis=0))
    tl.store(partials + _REF_KL, tl.sum(ref_kl, axis=0))
    tl.store(partials + _ENTROPY, tl.sum(entropy_sum, axis=0))
    tl.store(partials + _TOKENS, token_total)
    tl.store(partials + _PHI, phi)
    tl.store(partials + _DEGENERATE, degenerate)

    # Every thread's stores before the arrival, whose release makes them visible to the
    # program that arrives last (its acquire), which then reduces them all.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == segments - 1:
        _finish(partials_ptr, loss_ptr, metrics_ptr, grad_scale_ptr, segments, group_size, HAS_GROUPS, COUNT_TOKENS,
                FINISH_ROWS)


# --- launch configuration -----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _compute_capability(device: torch.device) -> tuple[int, int]:
    # A host-side property query: no device synchronisation.
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _token_launch(width: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_T, num_warps) for the per-response kernel (docs/architecture.md, "Triton: launch configuration by GPU generation"), for
    segments of ``width`` tokens on average (a padded batch's: its width).

    One program streams one response. Hopper (sm_90) needs about twice Ampere's bytes
    in flight per SM to cover its bandwidth, so its tile is twice as wide. Four tokens
    a thread keep an fp32 load one 16-byte vector.
    """
    widest = 2048 if _compute_capability(device) >= (9, 0) else 1024
    block = min(triton.next_power_of_2(max(width, 1)), widest)
    return block, max(1, min(16, block // 128))


def device_guard(device: torch.device):
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def aggregation(
    loss_agg_mode: int, loss_normalizer: float | None, max_response_length: int | None, segments: int
) -> tuple[float, bool, bool]:
    """(denominator, PER_RESPONSE_MEAN, COUNT_TOKENS) of ``aggregation_weight`` for an
    aggregation mode, from its row of tables.aggregations.AGGREGATIONS (aggregation.agg_weights).
    COUNT_TOKENS: the denominator is the batch's valid tokens, counted on the device and
    applied through ``grad_scale``. The constant L of ``times_max_length`` arrives
    resolved (the losses default it to a padded batch's width)."""
    rule = AGGREGATIONS[AGG_MODES[loss_agg_mode]]
    count_tokens = counts_batch_tokens(loss_agg_mode, loss_normalizer)
    if count_tokens and (rule.per_response_mean or rule.times_max_length):
        # grad_scale stands alone: teach the kernel the other factors first.
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


class _OptionSet:
    """What one option set fixes of the launch, formed once: the kernel's option
    arguments, the aggregation's rule, and a bound kernel per shape of a call (its inputs'
    presence, the tile)."""

    def __init__(self, group_size, advantage_estimator, normalize_std, std_eps, lambda_scale, loss_agg_mode, ratio_level, objective,
                 epsilon_low, epsilon_high, objective_options, beta, kl_estimator, entropy_coef, loss_normalizer,
                 max_response_length):
        name = OBJECTIVE_NAMES[objective]
        if RATIO_LEVELS[ratio_level] not in OBJECTIVES[name].ratio_levels:
            # LossConfig refuses it too; the kernel has no such variant (VESPO's weight, for
            # one, is formed per response).
            raise ValueError(f"objective {name!r} takes ratio_level in {OBJECTIVES[name].ratio_levels}, got "
                             f"{RATIO_LEVELS[ratio_level]!r}")
        self.has_kl = beta > 0
        self.estimator = ESTIMATORS[ESTIMATOR_NAMES[advantage_estimator]]
        self.arguments = dict(
            group_size=group_size or 1, std_eps=float(std_eps), lambda_scale=float(lambda_scale),
            **objective_arguments(objective, epsilon_low, epsilon_high, objective_options),
            beta=float(beta), entropy_coef=float(entropy_coef),
            RESPONSE_STEP=RESPONSE_STEPS.index(OBJECTIVES[name].response_step), RATIO_LEVEL=ratio_level,
            THROUGH_RATIO=OBJECTIVES[name].through_ratio, NORMALIZE_STD=normalize_std,
            SCOPE=SCOPES.index(self.estimator.scope), LEAVE_ONE_OUT=self.estimator.leave_one_out,
            BLOCK_G=triton.next_power_of_2(group_size or 1), HAS_KL=self.has_kl, KL_ESTIMATOR=kl_estimator,
        )
        # (denominator, PER_RESPONSE_MEAN, COUNT_TOKENS) of a call of S segments.
        self.aggregation = functools.partial(aggregation, loss_agg_mode, loss_normalizer, max_response_length)
        self.count_tokens = counts_batch_tokens(loss_agg_mode, loss_normalizer)
        self._kernels: dict[tuple, object] = {}

    def kernel(self, shape: tuple):
        """The bound kernel for a call of this ``shape``: (HAS_GROUPS, HAS_ANCHOR,
        PER_TOKEN_ADVANTAGES, PER_RESPONSE_MEAN, HAS_IMPORTANCE, HAS_ENTROPY, HAS_SELECTED,
        BLOCK_T, num_warps)."""
        kernel = self._kernels.get(shape)
        if kernel is None:
            flags = dict(zip(("HAS_GROUPS", "HAS_ANCHOR", "PER_TOKEN_ADVANTAGES", "PER_RESPONSE_MEAN",
                              "HAS_IMPORTANCE", "HAS_ENTROPY", "HAS_SELECTED", "BLOCK_T", "num_warps"), shape))
            kernel = self._kernels[shape] = bound_kernel(
                _surrogate_kernel, **self.arguments, **flags, COUNT_TOKENS=self.count_tokens,
                FINISH_ROWS=32 * flags["num_warps"])
        return kernel


@functools.lru_cache(maxsize=256)
def _option_set(*options) -> _OptionSet:
    return _OptionSet(*options)


def surrogate_forward(
    logprobs, old_logprobs, response_mask, cu_seqlens, rewards, advantages, response_advantages, anchor, ref_logprobs,
    importance_weights, entropy, selected, batch_totals, prior, group_size, advantage_estimator, normalize_std, std_eps,
    lambda_scale, loss_agg_mode,
    ratio_level, objective, epsilon_low, epsilon_high, objective_options, beta, kl_estimator, entropy_coef,
    loss_normalizer, max_response_length,
):
    """``hadw::surrogate_loss`` (schema in ``ops.schemas``): the loss, its gradient with
    respect to the log-probs and the entropy, the metrics in METRIC_NAMES order, and
    ``grad_scale`` (token-mean's 1 / N_tok, 0-d, where the gradients leave it out; else
    empty).

    Inputs are assumed validated (``validation``): per-token tensors [N] in the segments
    of ``cu_seqlens`` [S+1], rewards [S] or the caller's advantages, per token [N] or
    per response [S]. Only shapes and Python scalars steer the launch; no tensor value
    reaches the host.
    """
    options = _option_set(group_size, advantage_estimator, normalize_std, std_eps, lambda_scale, loss_agg_mode,
                          ratio_level, objective,
                          epsilon_low, epsilon_high, tuple(objective_options), beta, kl_estimator, entropy_coef,
                          loss_normalizer, max_response_length)
    (tokens,) = logprobs.shape
    segments = cu_seqlens.shape[0] - 1
    device = logprobs.device
    compute = accumulate_dtype(logprobs.dtype)
    denominator, per_response_mean, count_tokens = options.aggregation(segments)
    # The kernel writes every element of the outputs (without segments, there are none
    # but the loss and the metrics, zeros): no fill launches before it.
    if segments == 0:
        grad_scale = torch.ones((), dtype=compute, device=device) if count_tokens else \
            torch.empty((0,), dtype=compute, device=device)
        return (torch.zeros((), dtype=compute, device=device), torch.zeros(tokens, dtype=compute, device=device),
                torch.zeros((tokens,) if entropy is not None else (0,), dtype=compute, device=device),
                torch.zeros(len(METRIC_NAMES), dtype=torch.float32, device=device), grad_scale)
    grad_logprobs = torch.empty(tokens, dtype=compute, device=device)
    grad_entropy = torch.empty((tokens,) if entropy is not None else (0,), dtype=compute, device=device)
    loss = torch.empty((), dtype=compute, device=device)
    metrics = torch.empty(len(METRIC_NAMES), dtype=torch.float32, device=device)
    grad_scale = torch.empty(() if count_tokens else (0,), dtype=compute, device=device)
    partials = torch.empty((segments, _PARTIALS_WIDTH.value), dtype=compute, device=device)
    arrivals = torch.zeros((), dtype=torch.int32, device=device)

    has_groups = rewards is not None
    if has_groups and options.estimator.scope == "batch" and batch_totals is None:
        batch_totals = call_totals(rewards, group_size)  # the call's groups are the batch: one launch more
    per_token_advantages = advantages is not None
    caller_advantages = advantages if per_token_advantages else response_advantages
    # bool storage read as bytes: one byte per token, and any dtype works through `!= 0`.
    mask = response_mask.view(torch.uint8) if response_mask.dtype == torch.bool else response_mask
    selected_bytes = selected.view(torch.uint8) if selected is not None and selected.dtype == torch.bool else selected
    offsets = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    ref = ref_logprobs if options.has_kl else None
    kernel = options.kernel((has_groups, anchor is not None, per_token_advantages, per_response_mean,
                             importance_weights is not None, entropy is not None, selected is not None,
                             *_token_launch(-(-tokens // segments), device)))

    def stride(tensor):
        return 0 if tensor is None else tensor.stride(0)

    with device_guard(device):
        kernel(
            (segments,),
            logprobs, stride(logprobs),
            old_logprobs, stride(old_logprobs),
            mask, stride(mask),
            ref, stride(ref),
            importance_weights, stride(importance_weights),
            entropy, stride(entropy),
            selected_bytes, stride(selected_bytes),
            offsets,
            rewards, stride(rewards), anchor,
            batch_totals, prior, stride(prior), 0 if prior is None else prior.stride(1),
            caller_advantages, stride(caller_advantages),
            grad_logprobs, grad_entropy, partials, arrivals,
            loss, metrics, grad_scale,
            segments, float(denominator),
        )
    return loss, grad_logprobs, grad_entropy, metrics, grad_scale
