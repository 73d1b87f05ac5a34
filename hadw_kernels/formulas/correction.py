"""Rollout correction and token masks (docs/math.md, section 5d): the weights and masks that
a rollout engine's log-probs, the off-policy sequence mask and the entropy mask put on the
loss's tokens.

Every rule here reads per-token values the loss already holds ([N] floats: the behaviour,
rollout and current log-probs, the tokens' entropies), never [N, V]. :func:`correct`
turns them into one detached weight per token and the tokens left in the loss; every
backend then applies them as it applies a caller's ``importance_weights`` and mask, inside
its kernels, so each rule composes with every objective, aggregation and with HA-DW. A
rule is a row of tables/corrections.py's tables (CORRECTION_RULES, REJECTION_STATISTICS,
REJECTION_REDUCTIONS) and its formula a row of this module's (:data:`WEIGHT_RULES`,
:data:`STATISTICS`).

Hosts' names: TRL's ``vllm_importance_sampling_mode`` "token_truncate" is
``RolloutCorrection(level="token", rule="truncate", ...)``; verl's TIS is ``rule="truncate"``
with an upper bound, its IcePop ``rule="mask"`` with both; verl's ``rollout_rs`` filters are
``rejection`` (docs/options.md, "Rollout correction").
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, cast

import numpy as np
import torch

from ..batch.inputs import SurrogateBatch
from ..batch.token_layout import TokenLayout
from ..distributed import all_gather_rows, all_reduce
from ..objectives.table import LOG_RATIO_CLAMP
from ..tables.corrections import CORRECTION_RULES, REJECTION_STATISTICS, RejectionFilter
from ..tables.precision import accumulate_dtype

# Weight means below this leave batch normalisation off (verl's guard against dividing by 0).
BATCH_NORMALIZE_MIN_MEAN = 1e-8


def _truncate(weight, lower, upper):
    return weight if lower is None and upper is None else weight.clamp(min=lower, max=upper)


def _mask_outside(weight, lower, upper):
    outside = torch.zeros_like(weight, dtype=torch.bool)
    if lower is not None:
        outside |= weight < lower
    if upper is not None:
        outside |= weight > upper
    return weight.masked_fill(outside, 0.0)


# How the bounds [lower, upper] act on a raw weight w (tables.corrections.CORRECTION_RULES); a token
# whose weight the rule changed counts as corrected.
WEIGHT_RULES: dict[str, Callable] = {
    "truncate": _truncate,  # TRL's *_truncate, verl's TIS: w clamped into the bounds
    "mask": _mask_outside,  # TRL's *_mask, verl's IcePop: w = 0 outside them (the token stays counted)
}

# Each rejection statistic (tables.corrections.REJECTION_STATISTICS) of a token's log ratio
# x = log(pi_old / pi_rollout), verl's names.
STATISTICS: dict[str, Callable] = {
    "k1": lambda x: -x,
    "k2": lambda x: 0.5 * x.square(),
    "k3": lambda x: torch.expm1(x) - x,
}

assert set(WEIGHT_RULES) == set(CORRECTION_RULES) and set(STATISTICS) == set(REJECTION_STATISTICS), (
    "every rule and statistic of tables/corrections.py has its formula here"
)


class TokenCorrection(NamedTuple):
    """What :func:`correct` gives the loss: ``weights`` [N] multiply each token's policy
    term (None: all 1), ``keep`` [N] the tokens left in the loss (None: all),
    ``entropy_keep`` [N] the tokens of the entropy mask (for the entropy bonus; None: all),
    and the metrics (metrics.CORRECTION_METRIC_NAMES)."""

    weights: torch.Tensor | None
    keep: torch.Tensor | None
    entropy_keep: torch.Tensor | None
    metrics: dict


def needs_current_logprobs(config) -> bool:
    """Whether a rule reads the current policy's log-probs or entropies (the off-policy
    mask, the entropy mask): the linear loss then forms them before the loss's gradients
    (its recompute path)."""
    return config.off_policy_mask_threshold is not None or config.top_entropy_quantile < 1.0


@torch.no_grad()
def correct(batch: SurrogateBatch, *, token_advantage: torch.Tensor | None) -> TokenCorrection:
    """The weights and masks of the batch's rollout correction, off-policy mask and entropy
    mask, from [N] tensors in its layout: its mask, its behaviour log-probs and its
    current ones (which the off-policy mask reads; None in the linear loss before its
    sweep, where no rule that reads them runs), the rollout engine's log-probs
    (``batch.rollout_logprobs``), ``token_advantage`` each token's advantage (its sign),
    and each token's entropy (``batch.mask_entropy``, the entropy mask's)."""
    config, layout, old_logprobs = batch.config, batch.layout, batch.behaviour_logprobs()
    rollout_logprobs, entropy = batch.rollout_logprobs, batch.mask_entropy
    mask = batch.mask.bool()
    dtype = torch.float64 if old_logprobs.dtype == torch.float64 else torch.float32
    counted = mask.sum().clamp(min=1).to(dtype)
    weights = None
    keep = None
    entropy_keep = None
    metrics = {}

    def counted_mean(values):
        return torch.where(mask, values.to(dtype), torch.zeros((), dtype=dtype, device=mask.device)).sum() / counted

    correction = config.rollout_correction
    if correction is not None:
        if rollout_logprobs is None:  # validation refuses it first (_correction_inputs)
            raise ValueError("rollout_correction needs rollout_logprobs (the rollout engine's log-probs of the tokens)")
        # No rollout log-prob (NaN: the engine could not score the token) is no evidence: ratio 1.
        log_ratio = torch.where(mask, (old_logprobs.to(dtype) - rollout_logprobs.to(dtype)).nan_to_num(0.0), 0.0)
        if correction.level is not None:
            if correction.level == "token":
                raw = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            else:
                summed = layout.segment_sum(log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                raw = layout.expand(torch.exp(summed))
            shaped = WEIGHT_RULES[correction.rule](raw, correction.lower, correction.upper)
            metrics["rollout_is_mean"] = counted_mean(shaped)
            metrics["rollout_is_corrected_frac"] = counted_mean(shaped != raw)
            if correction.batch_normalize:
                shaped = shaped / _batch_mean(shaped, mask, layout, correction.level)
            weights = torch.where(mask, shaped, 0.0)
        if correction.rejection:
            keep = mask.clone()
            for rejection in correction.rejection:
                keep &= _passes(rejection, log_ratio, mask, layout)
            metrics["rollout_rejected_frac"] = counted_mean(mask & ~keep)

    if config.off_policy_mask_threshold is not None:
        logprobs = batch.current_logprobs()
        if token_advantage is None:  # the losses form it for this mask (loss._corrected_surrogate)
            raise ValueError("the off-policy mask reads each token's advantage: pass token_advantage")
        # DeepSeek-V3.2's off-policy sequence mask, as TRL: drop a response of negative
        # advantage whose sampler drifted from the current policy by more than the threshold.
        sampler = old_logprobs if rollout_logprobs is None else rollout_logprobs
        drift = torch.where(mask, (sampler.to(dtype) - logprobs.detach().to(dtype)).nan_to_num(0.0), 0.0)
        mean_drift = layout.segment_sum(drift) / layout.segment_sum(mask).clamp(min=1).to(dtype)
        kept = (token_advantage >= 0) | layout.expand(mean_drift <= config.off_policy_mask_threshold)
        metrics["off_policy_masked_frac"] = counted_mean(~kept)
        weights = _times(weights, kept.to(dtype))

    if config.top_entropy_quantile < 1.0:
        if entropy is None:  # validation asks the surrogate loss for it; the linear loss forms it
            raise ValueError("top_entropy_quantile < 1 needs entropy, each token's entropy under the current policy")
        # In fp32 at least, the comparison too: a bfloat16 one would round the quantile to
        # bfloat16 and keep tokens below it.
        read = accumulate_dtype(entropy.dtype) if config.entropy_mask_dtype == "entropy" else torch.float32
        entropies = entropy.detach().to(read)
        threshold = _entropy_threshold(entropies, mask, 1.0 - config.top_entropy_quantile)
        entropy_keep = mask & (entropies >= threshold)
        metrics["entropy_masked_frac"] = counted_mean(mask & ~entropy_keep)
        weights = _times(weights, entropy_keep.to(dtype))
    return TokenCorrection(weights, keep, entropy_keep, metrics)


def _times(weights: torch.Tensor | None, factor: torch.Tensor) -> torch.Tensor:
    return factor if weights is None else weights * factor


def _passes(rejection: RejectionFilter, log_ratio: torch.Tensor, mask: torch.Tensor,
            layout: TokenLayout) -> torch.Tensor:
    """[N] bool: the tokens ``rejection`` keeps (log ratios clamped to +-LOG_RATIO_CLAMP, as verl)."""
    statistic = STATISTICS[rejection.statistic](log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    reduce = rejection.reduction
    if reduce == "sum":
        statistic = layout.expand(layout.segment_sum(torch.where(mask, statistic, 0.0)))
    elif reduce == "mean":
        lengths = layout.segment_sum(mask).clamp(min=1).to(statistic.dtype)
        statistic = layout.expand(layout.segment_sum(torch.where(mask, statistic, 0.0)) / lengths)
    elif reduce == "max":
        # Every statistic with a max is non-negative: 0 stands in for the masked tokens.
        per_response = torch.zeros(layout.segments, dtype=statistic.dtype, device=statistic.device)
        per_response = per_response.scatter_reduce(0, layout.token_segment, torch.where(mask, statistic, 0.0), "amax")
        statistic = layout.expand(per_response)
    if REJECTION_STATISTICS[rejection.statistic]:
        # RejectionFilter.__post_init__ sets lower (1 / upper by default) for every statistic with one.
        lower = cast(float, rejection.lower)
        return (statistic >= math.log(lower)) & (statistic <= math.log(rejection.upper))
    return statistic <= rejection.upper


def _batch_mean(weights: torch.Tensor, mask: torch.Tensor, layout: TokenLayout, level: str) -> torch.Tensor:
    """The weights' mean over the counted tokens (token level) or the responses with one
    (sequence level), over every rank when torch.distributed is initialised; 1 below
    BATCH_NORMALIZE_MIN_MEAN."""
    if level == "token":
        total = torch.where(mask, weights, 0.0).sum()
        count = mask.sum().to(weights.dtype)
    else:
        lengths = layout.segment_sum(mask)
        per_response = layout.segment_sum(torch.where(mask, weights, 0.0)) / lengths.clamp(min=1).to(weights.dtype)
        total = per_response.sum()
        count = (lengths > 0).sum().to(weights.dtype)
    totals = all_reduce(torch.stack([total, count]))
    mean = totals[0] / totals[1].clamp(min=1)
    return torch.where(mean > BATCH_NORMALIZE_MIN_MEAN, mean, torch.ones_like(mean))


def _entropy_threshold(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The ``quantile`` of the counted tokens' ``entropies`` (float32 or float64) over every
    rank, from a sort of [N] floats, by torch.quantile's own arithmetic (its rank and
    interpolation in the entropies' dtype: the value TRL's torch.quantile gives, without
    its limit of 2^24 values); the ranks' entropies are gathered when torch.distributed is
    initialised (a collective)."""
    values = all_gather_rows(entropies[mask])
    if values.numel() == 0:
        return torch.full((), math.inf, device=entropies.device)
    ordered = values.sort().values
    # The rank q (N - 1) rounded as a product in ``dtype`` (torch.quantile's), on the host.
    host_float = _HOST_FLOATS[ordered.dtype]
    rank = float(host_float(quantile) * host_float(ordered.numel() - 1))
    below = math.floor(rank)
    return torch.lerp(ordered[below], ordered[math.ceil(rank)], rank - below)


_HOST_FLOATS: dict[torch.dtype, type[np.floating]] = {torch.float32: np.float32, torch.float64: np.float64}
