"""Per-token quantities of the surrogate in plain PyTorch, through autograd: the ratio in
each ratio form (objectives.table.RATIO_LEVELS), the KL estimate (config.KL_ESTIMATORS) and a masked
mean. The reference (reference/surrogate.py) builds the loss from them; the losses'
Python-side terms (the bias-corrected KL) use them beside the backends' ops."""

from __future__ import annotations

import torch

from ..batch.token_layout import TokenLayout
from ..config.loss_config import K3_LOG_RATIO_CLAMP, K3_VALUE_CLAMP, LossConfig
from ..objectives.table import LOG_RATIO_CLAMP, OBJECTIVES


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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = values.float()
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def own_token_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rho_t = exp(l_t - l_old_t) [N] with its gradient, the log-ratio clamped to
    +-LOG_RATIO_CLAMP (1 at uncounted tokens): the token ratio form's, and the one TRL's
    bias-corrected KL weighs by at token level whatever the objective's form."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def token_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor,
                layout: TokenLayout, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rho [N] with its gradient, the ratio the metrics count, the mask they count it
    over) in ``config.ratio_level``'s form (objectives.table.RATIO_LEVELS); an objective whose
    response step is clipped_log_ratio_mean (GMPO) clips the log-ratios first, by its
    formula (its row's response_formula). Every log-ratio entering exp is clamped to
    +-LOG_RATIO_CLAMP."""
    if config.ratio_level == "token":  # (no objective with a response step takes it)
        ratio = own_token_ratio(logprobs, old_logprobs, mask)
        return ratio, ratio.detach(), mask
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    row = OBJECTIVES[config.objective]
    if row.response_step == "clipped_log_ratio_mean" and row.response_formula is not None:
        clipped = row.response_formula(log_ratio, advantage, config)
        log_ratio = torch.where(mask, clipped, torch.zeros_like(log_ratio))
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
