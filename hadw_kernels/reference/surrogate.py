"""The clipped surrogate with HA-DW (docs/math.md, section 5), as :class:`LossConfig` describes it.

Plain PyTorch with autograd: the reference every fast path is tested against, and the
"torch" backend. It computes in the inputs' dtype, as eager PyTorch code would.

Everything that is data (old and reference log-probs, rewards, advantages, importance
weights) is detached: the loss differentiates with respect to the current log-probs
(and the entropy) only, whatever the caller's tensors require.
"""

from __future__ import annotations

import torch

from ..advantage import group_advantages, hadw_weights
from ..config import AGGREGATIONS, K3_LOG_RATIO_CLAMP, K3_VALUE_CLAMP, LOG_RATIO_CLAMP, METRIC_NAMES, LossConfig
from ..layout import TokenLayout
from ..objectives import VALUES, gmpo_log_ratio, vespo_weight
from ..precision import accumulate_dtype


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (config.KL_ESTIMATORS)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "abs":
        return log_ratio.abs()
    ref_delta = (-log_ratio).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    # expm1 keeps the small values of a policy near the reference.
    return (torch.expm1(ref_delta) - ref_delta).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def aggregate(values: torch.Tensor, mask: torch.Tensor, layout: TokenLayout, config: LossConfig) -> torch.Tensor:
    """Reduces per-token values [N] to the loss by ``config.loss_agg_mode``:
    sum_i w_i sum_t v_it over the valid tokens of each segment, w from :func:`agg_weights`."""
    sums = layout.segment_sum(torch.where(mask, values, torch.zeros_like(values)))
    return (sums * agg_weights(mask, layout, config).to(sums.dtype)).sum()


def agg_weights(mask: torch.Tensor, layout: TokenLayout, config: LossConfig) -> torch.Tensor:
    """w_i [S]: the weight of each valid token of response i, by the mode's row of
    :data:`config.AGGREGATIONS`. Float64, for the kernels that take it. The constant L of
    ``times_max_length`` is ``config.max_response_length``, which the losses resolve
    (the mask width of a padded batch by default)."""
    rule = AGGREGATIONS[config.loss_agg_mode]
    lengths = layout.segment_sum(mask).to(torch.float64)
    if rule.count == "tokens":
        count = config.loss_normalizer or lengths.sum().clamp(min=1)
    elif rule.count == "responses":
        count = config.loss_normalizer or max(layout.segments, 1)
    elif rule.count == "one":
        count = config.loss_normalizer or 1
    else:
        raise ValueError(f"aggregation count {rule.count!r} has no meaning here")
    weights = torch.ones_like(lengths) / count
    if rule.per_response_mean:
        weights = weights / lengths.clamp(min=1)
    if rule.times_max_length:
        weights = weights / config.max_response_length
    return weights


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = values.float()
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def weighted_advantages(
    rewards: torch.Tensor | None,
    advantages: torch.Tensor | None,
    config: LossConfig,
    anchor: float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A, Phi [S] or None): the caller's advantages (as given: per token [N] in the
    losses' calls, [S] in hadw_advantages'), or A_hat * Phi [S] from rewards."""
    if advantages is not None:
        return advantages.detach().to(accumulate_dtype(advantages.dtype)), None
    rewards = rewards.detach()
    advantage_hat = group_advantages(
        rewards, config.group_size, normalize_std=config.normalize_std, std_eps=config.std_eps
    )
    if anchor is None:
        phi = torch.ones_like(advantage_hat)
    else:
        phi = hadw_weights(rewards, config.group_size, anchor, lambda_scale=config.lambda_scale)
    return advantage_hat * phi, phi


def token_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor,
                layout: TokenLayout, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rho [N] with its gradient, the ratio the metrics count, the mask they count it
    over) in ``config.ratio_level``'s form (config.RATIO_LEVELS); GMPO's log-ratios are
    clipped first (objectives.gmpo_log_ratio). Every log-ratio entering exp is clamped to
    +-LOG_RATIO_CLAMP."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if config.objective == "gmpo":
        log_ratio = torch.where(mask, gmpo_log_ratio(log_ratio, advantage, config), torch.zeros_like(log_ratio))
    if config.ratio_level == "token":
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return ratio, ratio.detach(), mask
    lengths = layout.segment_sum(mask)
    sequence_log_ratio = layout.segment_sum(log_ratio) / lengths.clamp(min=1)
    metric_ratio = torch.exp(sequence_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if config.ratio_level == "sequence":
        # s_i itself: every token of the response carries it and its gradient.
        ratio = layout.expand(torch.exp(sequence_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)))
    else:  # gspo_token: log s_it = logp_t - sg(logp_t) + sg(log s_i)
        own_token = torch.where(mask, logprobs - logprobs.detach(), torch.zeros_like(logprobs))
        carried = own_token + layout.expand(sequence_log_ratio.detach())
        ratio = torch.exp(carried.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return ratio, metric_ratio, lengths > 0


def surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    layout: TokenLayout,
    config: LossConfig,
    *,
    rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    anchor: float | torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its metrics. Inputs are assumed validated (see ``validation``).

    Per-token tensors are [N] in ``layout``'s segments (one response each); exactly one
    of ``rewards`` [S] (each group's ``config.group_size`` segments contiguous) and
    ``advantages`` [N] (the caller's, per token: a per-response one repeated) is given. ``importance_weights`` [N] are the
    rollout engine's correction per token (a per-response weight repeated over its
    tokens); ``entropy`` [N] enters as ``- entropy_coef * aggregate(entropy)``.

    The objective (``config.objective``, objectives.py) is a per-token loss of the
    token's ratio in ``config.ratio_level``'s form (:func:`token_ratio`), its advantage
    and its log-prob, times the token's importance weight, aggregated by
    ``config.loss_agg_mode``.
    """
    mask = response_mask.bool()
    # In fp32 at least (precision.py), as every kernel computes: a float16 ratio overflows
    # once the log-ratio passes 11. The gradient reaches the inputs in their own dtype.
    compute = accumulate_dtype(logprobs.dtype)
    logprobs = logprobs.to(compute)
    old_logprobs = old_logprobs.detach().to(compute)
    entropy = None if entropy is None else entropy.to(compute)
    advantage, phi = weighted_advantages(rewards, advantages, config, anchor)
    advantage = advantage.to(torch.promote_types(advantage.dtype, logprobs.dtype))
    token_advantage = layout.expand(advantage) if advantages is None else advantage
    # Every per-token input is masked before it meets another: padding may hold inf or
    # NaN, and a sequence ratio gathers its tokens' gradients (NaN * 0 is NaN).
    token_advantage = torch.where(mask, token_advantage, torch.zeros_like(token_advantage))

    ratio, metric_ratio, ratio_mask = token_ratio(logprobs, old_logprobs, mask, token_advantage, layout, config)
    weight = None
    if config.objective == "vespo":
        summed = layout.segment_sum(torch.where(mask, (logprobs - old_logprobs).detach(), torch.zeros_like(logprobs))
                                    .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = vespo_weight(layout.expand(summed), token_advantage, config)
    own_logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    per_token = VALUES[config.objective](ratio, token_advantage, own_logprobs, weight, config)
    if importance_weights is not None:
        per_token = per_token * torch.where(mask, importance_weights.detach(), torch.zeros_like(per_token))
    loss = aggregate(per_token, mask, layout, config)

    metrics: dict[str, torch.Tensor] = {}
    if config.beta > 0:
        zero = torch.zeros_like(logprobs)
        ref_kl = kl_estimate(own_logprobs, torch.where(mask, ref_logprobs.detach(), zero), config.kl_estimator)
        loss = loss + config.beta * aggregate(ref_kl, mask, layout, config)
        metrics["ref_kl"] = masked_mean(ref_kl.detach(), mask)
    if entropy is not None:
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * aggregate(entropy, mask, layout, config)
        metrics["entropy_mean"] = masked_mean(entropy.detach(), mask)

    with torch.no_grad():
        # Where the ratio is per response, the sign of the response's advantage (of the
        # sum of its tokens' advantages).
        if not config.sequence_level:
            signed_advantage = token_advantage
        elif advantages is None:
            signed_advantage = advantage
        else:
            signed_advantage = layout.segment_sum(torch.where(mask, token_advantage, torch.zeros_like(token_advantage)))
        low = (metric_ratio < 1.0 - config.epsilon_low) & (signed_advantage < 0)
        high = (metric_ratio > 1.0 + config.epsilon_high) & (signed_advantage > 0)
        metrics["clip_frac_low"] = masked_mean(low, ratio_mask)
        metrics["clip_frac_high"] = masked_mean(high, ratio_mask)
        metrics["ratio_mean"] = masked_mean(metric_ratio, ratio_mask)
        # k3 estimate of KL(pi_old || pi) from the samples of pi_old.
        token_log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs)).detach().clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        metrics["approx_kl"] = masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask)
        if phi is not None:
            metrics.update(group_metrics(rewards, phi, config.group_size))
    return loss, {name: metrics[name] for name in METRIC_NAMES if name in metrics}


def group_metrics(rewards: torch.Tensor, phi: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """phi_mean and zero_std_frac (groups whose rewards are all equal)."""
    grouped = rewards.detach().view(-1, group_size)
    degenerate = (grouped.amax(dim=1) == grouped.amin(dim=1)).float()
    return {
        "phi_mean": phi.float().sum() / max(phi.numel(), 1),
        "zero_std_frac": degenerate.sum() / max(degenerate.numel(), 1),
    }
