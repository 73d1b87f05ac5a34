"""verl's metrics of its policy losses, as each loss's own function computes them
(docs/integrations/verl.md, "How it maps onto verl"): one rule per function that defines them
(:data:`CLIP_METRICS`), which the ``hadw_`` losses (``verl.py``) report beside the fused
loss. Imports no verl.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..objectives.formulas import dppo_moved_within, ppo_terms
from ..objectives.table import LOG_RATIO_CLAMP


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # As verl's masked_mean: the count plus 1e-8 (in the default dtype: 0 without valid
    # tokens); verl counts its fractions in float32, so they are formed here the same way.
    if values.dtype == torch.bool:
        values = values.float()
    return (values * mask).sum() / (mask.sum() + 1e-8)


class MetricInputs(NamedTuple):
    """What verl's metric rules read: the call's tensors (detached), its log-ratio (clamped
    to +-20 where the loss's verl function clamps it), its clip range, the LossConfig
    options it set, and the share of tokens its objective selected (None: it selects none)."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    epsilon_low: float
    epsilon_high: float
    options: dict
    selected_frac: torch.Tensor | None


def _ppo_kl(terms: MetricInputs) -> torch.Tensor:
    return _token_mean(-terms.log_ratio, terms.mask)


def _vanilla_metrics(terms: MetricInputs) -> dict:
    unclipped, clipped = ppo_terms(torch.exp(terms.log_ratio), terms.advantages, terms.epsilon_low,
                                    terms.epsilon_high)
    # Tokens whose clipped term is the larger loss; and those whose loss the dual clip
    # bounds: a negative advantage, a loss above -A c.
    lower = (torch.maximum(unclipped, clipped) > -terms.advantages * terms.options["dual_clip"]) \
        & (terms.advantages < 0)
    return {"actor/pg_clipfrac": _token_mean(clipped > unclipped, terms.mask), "actor/ppo_kl": _ppo_kl(terms),
            "actor/pg_clipfrac_lower": _token_mean(lower, terms.mask)}


def _gspo_metrics(terms: MetricInputs) -> dict:
    # Each token carries its response's ratio, whose log verl clamps above at 10.
    mask = terms.mask
    sequence = torch.where(mask, terms.log_ratio, 0.0).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    ratio = torch.exp(sequence.clamp(max=10.0))[:, None].expand_as(terms.log_ratio)
    unclipped, clipped = ppo_terms(ratio, terms.advantages, terms.epsilon_low, terms.epsilon_high)
    return {"actor/pg_clipfrac": _token_mean(clipped > unclipped, mask), "actor/ppo_kl": _ppo_kl(terms),
            "actor/pg_clipfrac_lower": 0.0}


def _cispo_metrics(terms: MetricInputs) -> dict:
    # Ratios outside the range on either side, whatever the advantage.
    ratio = torch.exp(terms.log_ratio)
    outside = ratio != ratio.clamp(1.0 - terms.epsilon_low, 1.0 + terms.epsilon_high)
    return {"actor/pg_clipfrac": _token_mean(outside, terms.mask), "actor/ppo_kl": _ppo_kl(terms),
            "actor/pg_clipfrac_lower": 0.0}


def _geo_mean_metrics(terms: MetricInputs) -> dict:
    # Log-ratios outside [-epsilon_low, epsilon_high]: with a positive advantage the clip
    # fraction, with a negative one the lower fraction.
    outside = terms.log_ratio != terms.log_ratio.clamp(-terms.epsilon_low, terms.epsilon_high)
    return {"actor/pg_clipfrac": _token_mean(outside & (terms.advantages > 0), terms.mask),
            "actor/ppo_kl": _ppo_kl(terms),
            "actor/pg_clipfrac_lower": _token_mean(outside & (terms.advantages < 0), terms.mask)}


def _sapo_metrics(terms: MetricInputs) -> dict:
    return {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": _ppo_kl(terms), "actor/pg_clipfrac_lower": 0.0}


def _dppo_metrics(terms: MetricInputs, objective: str) -> dict:
    # The tokens DPPO's mask drops, and those it keeps whose ratio its cap truncates.
    kept = dppo_moved_within(terms.log_prob, terms.old_log_prob, terms.advantages, terms.epsilon_low,
                             terms.epsilon_high, objective).float()
    capped = (torch.exp(terms.log_ratio) > terms.options["ratio_cap"]).float() * kept
    return {"actor/pg_clipfrac": _token_mean(1.0 - kept, terms.mask), "actor/ppo_kl": _ppo_kl(terms),
            "actor/pg_clipfrac_lower": _token_mean(capped, terms.mask)}


def _clip_cov_metrics(terms: MetricInputs) -> dict:
    # The tokens its draw zeroed: the loss's own selection.
    return {"actor/pg_clipfrac": terms.selected_frac, "actor/ppo_kl": _ppo_kl(terms)}


def _kl_cov_metrics(terms: MetricInputs) -> dict:
    return {"actor/ppo_kl": _token_mean(terms.log_ratio.abs(), terms.mask)}


def _dro_metrics(terms: MetricInputs) -> dict:
    return {"actor/ppo_kl": _ppo_kl(terms)}


# verl's metric rules, by the loss whose function defines them: each gives the metrics
# verl's function returns, by name (a float 0.0 where verl reports a constant), and
# whether verl clamps the log-ratio to +-20 (before its ratio and its ppo_kl alike): the
# rule then receives it clamped.
CLIP_METRICS: dict[str, tuple[Callable[[MetricInputs], dict], bool]] = {
    "vanilla": (_vanilla_metrics, True),
    "gspo": (_gspo_metrics, False),
    "sapo": (_sapo_metrics, True),
    "geo_mean": (_geo_mean_metrics, False),
    "cispo": (_cispo_metrics, True),
    "dppo_tv": (functools.partial(_dppo_metrics, objective="dppo_tv"), True),
    "dppo_kl": (functools.partial(_dppo_metrics, objective="dppo_kl"), True),
    "clip_cov": (_clip_cov_metrics, False),
    "kl_cov": (_kl_cov_metrics, False),
    "dro": (_dro_metrics, False),
}


def verl_metrics(loss, old_log_prob, log_prob, advantages, mask, epsilon_low, epsilon_high,
                 options: dict, selected_frac=None) -> dict[str, float]:
    """verl's metrics of ``loss`` (a row of ``verl.VERL_POLICY_LOSSES``: its ``metrics``
    names the rule) on these tensors, as its own function computes them;
    ``options``: the LossConfig options the call set, ``selected_frac`` the loss's metric
    of that name (an objective that selects tokens)."""
    if loss.metrics is None:
        return {}
    rule, kl_clamped = CLIP_METRICS[loss.metrics]
    with torch.no_grad():
        log_prob, old_log_prob = log_prob.detach(), old_log_prob.detach()
        log_ratio = log_prob - old_log_prob
        if kl_clamped:
            log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        metrics = rule(MetricInputs(log_prob, old_log_prob, log_ratio, advantages.detach(), mask, epsilon_low,
                                    epsilon_high, options, selected_frac))
        return {name: value if isinstance(value, float) else value.item() for name, value in metrics.items()}
