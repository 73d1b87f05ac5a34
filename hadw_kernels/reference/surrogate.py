"""The clipped surrogate with HA-DW (docs/math.md, section 5), as :class:`LossConfig` describes it.

Plain PyTorch with autograd: the reference every fast path is tested against, and the
"torch" backend. It computes in the inputs' dtype, as eager PyTorch code would.

Everything that is data (old and reference log-probs, rewards, advantages, the anchor,
importance weights) is detached: the loss differentiates with respect to the current log-probs
(and the entropy) only, whatever the caller's tensors require.
"""

from __future__ import annotations

import torch

from ..advantage.group import call_advantages, group_metrics
from ..batch.inputs import SurrogateBatch
from ..formulas.aggregation import aggregate
from ..formulas.token_terms import kl_estimate, masked_mean, token_ratio
from ..objectives.table import LOG_RATIO_CLAMP, OBJECTIVES
from ..tables.metrics import ordered_metrics
from ..tables.precision import accumulate_dtype


def surrogate_loss(batch: SurrogateBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its metrics (none unless ``batch.with_metrics``). Inputs are assumed
    validated (see ``validation``).

    Exactly one of ``rewards`` [S] (each group's ``config.group_size`` segments
    contiguous), ``advantages`` [N] and ``response_advantages`` [S] is given
    (batch.SurrogateBatch); ``entropy`` enters
    as ``- entropy_coef * aggregate(entropy)``.

    The objective (``config.objective``, objectives.py) is a per-token loss of the
    token's ratio in ``config.ratio_level``'s form (token_terms.token_ratio), its advantage
    and its log-prob, times the token's importance weight, aggregated by
    ``config.loss_agg_mode``.
    """
    layout, config, mask = batch.layout, batch.config, batch.mask.bool()
    importance_weights, selected = batch.importance_weights, batch.selected
    # In fp32 at least (precision.py), as every kernel computes: a float16 ratio overflows
    # once the log-ratio passes 11. The gradient reaches the inputs in their own dtype.
    given_logprobs = batch.current_logprobs()
    compute = accumulate_dtype(given_logprobs.dtype)
    logprobs = given_logprobs.to(compute)
    old_logprobs = batch.behaviour_logprobs().detach().to(compute)
    entropy = None if batch.entropy is None else batch.entropy.to(compute)
    token_advantage, response_advantage, phi = call_advantages(batch)
    token_advantage = token_advantage.to(torch.promote_types(token_advantage.dtype, logprobs.dtype))
    # Every per-token input is masked before it meets another: padding may hold inf or
    # NaN, and a sequence ratio gathers its tokens' gradients (NaN * 0 is NaN).
    token_advantage = torch.where(mask, token_advantage, torch.zeros_like(token_advantage))

    ratio, metric_ratio, ratio_mask = token_ratio(logprobs, old_logprobs, mask, token_advantage, layout, config)
    # The objective's per-token weight: its response step's (VESPO's phi), or the batch
    # statistic's selection.
    objective = OBJECTIVES[config.objective]
    weight = None
    if objective.selects_tokens:
        weight = torch.zeros_like(logprobs) if selected is None else (selected & mask).to(logprobs.dtype)
    if objective.response_step == "log_ratio_sum" and objective.response_formula is not None:
        summed = layout.segment_sum(torch.where(mask, (logprobs - old_logprobs).detach(), torch.zeros_like(logprobs))
                                    .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = objective.response_formula(layout.expand(summed), token_advantage, config)
    own_logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    own_old_logprobs = torch.where(mask, old_logprobs, torch.zeros_like(old_logprobs))
    per_token = objective.value(ratio, token_advantage, own_logprobs, own_old_logprobs, weight, config)
    if importance_weights is not None:
        per_token = per_token * torch.where(mask, importance_weights.detach(), torch.zeros_like(per_token))
    loss = aggregate(per_token, mask, layout, config)

    metrics: dict[str, torch.Tensor] = {}
    if config.beta > 0:
        if batch.ref_logprobs is None:  # validation refuses this call first (check_batch_inputs)
            raise ValueError("beta > 0 needs ref_logprobs (the reference policy's log-probs)")
        zero = torch.zeros_like(logprobs)
        ref_kl = kl_estimate(own_logprobs, torch.where(mask, batch.ref_logprobs.detach(), zero), config.kl_estimator)
        loss = loss + config.beta * aggregate(ref_kl, mask, layout, config)
        metrics["ref_kl"] = masked_mean(ref_kl.detach(), mask)
    if entropy is not None:
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * aggregate(entropy, mask, layout, config)
        metrics["entropy_mean"] = masked_mean(entropy.detach(), mask)
    if not batch.with_metrics:
        return loss, {}

    with torch.no_grad():
        # Where the ratio is per response, the sign of the response's advantage (of the
        # sum of its tokens' advantages).
        if not config.sequence_level:
            signed_advantage = token_advantage
        elif response_advantage is not None:
            signed_advantage = response_advantage
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
        if phi is not None and batch.rewards is not None:  # phi is formed from rewards alone
            metrics.update(group_metrics(batch.rewards, phi, config.reward_group_size()))
    return loss, ordered_metrics(metrics)


