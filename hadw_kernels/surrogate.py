"""The clipped surrogates grpo, dapo, gspo and dr_grpo with HA-DW (SPEC section 5).

Plain PyTorch with autograd: the reference every fast path is tested against, and the
"torch" backend. It computes in the inputs' dtype, as eager PyTorch code would.
"""

from __future__ import annotations

import torch

from .advantage import group_advantages, hadw_weights
from .config import LOG_RATIO_CLAMP, LossConfig


def clipped_objective(
    ratio: torch.Tensor, advantage: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """-min(rho A, clip(rho) A), then bounded by -c A for negative A under dual clip."""
    unclipped = -ratio * advantage
    clipped = -ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * advantage
    loss = torch.maximum(unclipped, clipped)
    if config.dual_clip is not None:
        loss = torch.where(advantage < 0, torch.minimum(loss, -config.dual_clip * advantage), loss)
    return loss


def aggregate(values: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Reduces per-token values [B, T] to the loss type's batch mean."""
    masked = torch.where(mask, values, torch.zeros_like(values))
    batch = values.shape[0]
    if config.loss_type == "dapo":
        tokens = config.loss_normalizer or mask.sum().clamp(min=1)
        return masked.sum() / tokens
    responses = config.loss_normalizer or batch
    if config.loss_type == "dr_grpo":
        max_length = config.max_response_length or values.shape[1]
        return masked.sum() / max_length / responses
    lengths = mask.sum(dim=-1).clamp(min=1)
    return (masked.sum(dim=-1) / lengths).sum() / responses


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = values.float()
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: LossConfig,
    *,
    anchor: float | torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its metrics. Inputs are assumed validated (see ``validation``).

    ``importance_weights`` are the rollout engine's correction, [B, T] per token or [B]
    per response (gspo takes [B] only); ``entropy`` [B, T] enters as
    ``- entropy_coef * aggregate(entropy)``.
    """
    mask = response_mask.bool()
    lengths = mask.sum(dim=-1)
    advantage_hat = group_advantages(rewards, config.group_size, normalize_std=config.normalize_std)
    if anchor is None:
        phi = torch.ones_like(advantage_hat)
    else:
        phi = hadw_weights(rewards, config.group_size, anchor, lambda_scale=config.lambda_scale)
    advantage = advantage_hat * phi

    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if config.sequence_level:
        sequence_log_ratio = log_ratio.sum(dim=-1) / lengths.clamp(min=1)
        ratio = torch.exp(sequence_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        per_response = clipped_objective(ratio, advantage, config)
        if importance_weights is not None:
            per_response = per_response * importance_weights
        per_response = torch.where(lengths > 0, per_response, torch.zeros_like(per_response))
        loss = per_response.sum() / (config.loss_normalizer or per_response.shape[0])
        ratio_mask = lengths > 0
        token_log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        signed_advantage = advantage
    else:
        token_log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(token_log_ratio)
        per_token = clipped_objective(ratio, advantage[:, None], config)
        if importance_weights is not None:
            weights = importance_weights if importance_weights.dim() == 2 else importance_weights[:, None]
            per_token = per_token * weights
        loss = aggregate(per_token, mask, config)
        ratio_mask = mask
        signed_advantage = advantage[:, None].expand_as(ratio)

    metrics: dict[str, torch.Tensor] = {}
    if config.beta > 0:
        ref_delta = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        ref_kl = torch.expm1(ref_delta) - ref_delta  # expm1 keeps small on-policy values
        loss = loss + config.beta * aggregate(ref_kl, mask, config)
        metrics["ref_kl"] = _masked_mean(ref_kl.detach(), mask)
    if entropy is not None:
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * aggregate(entropy, mask, config)
        metrics["entropy_mean"] = _masked_mean(entropy.detach(), mask)

    with torch.no_grad():
        ratio = ratio.detach()
        low = (ratio < 1.0 - config.epsilon_low) & (signed_advantage < 0)
        high = (ratio > 1.0 + config.epsilon_high) & (signed_advantage > 0)
        metrics["clip_frac_low"] = _masked_mean(low, ratio_mask)
        metrics["clip_frac_high"] = _masked_mean(high, ratio_mask)
        metrics["ratio_mean"] = _masked_mean(ratio, ratio_mask)
        # k3 estimate of KL(pi_old || pi) from the samples of pi_old.
        approx_kl = torch.expm1(token_log_ratio.detach()) - token_log_ratio.detach()
        metrics["approx_kl"] = _masked_mean(approx_kl, mask)
        metrics["phi_mean"] = phi.float().mean()
        grouped = rewards.view(-1, config.group_size)
        metrics["zero_std_frac"] = (grouped.amax(dim=1) == grouped.amin(dim=1)).float().mean()
    return loss, metrics
