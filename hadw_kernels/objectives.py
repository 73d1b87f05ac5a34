"""The policy objectives of ``config.OBJECTIVES`` (docs/math.md, section 5): each a
per-token loss to minimise, written once here as a function of the token's ratio rho,
its advantage A and its log-prob l, with its derivative.

``value`` is what the reference (reference/surrogate.py) differentiates; ``slope`` gives
(d value / d rho, d value / d l) as autograd does, the form the C++ and Triton kernels
transcribe (one branch per objective); tests/test_objectives.py holds every slope to
autograd's at random points and at the edges (ties, clip bounds). Quantities taken
through a stop-gradient (CISPO's clipped ratio, VESPO's weight) enter as constants.

VESPO's weight and GMPO's ratio need the whole response first: :func:`gmpo_log_ratio` and
:func:`vespo_weight` are those per-response steps.
"""

from __future__ import annotations

import math

import torch

from .config import LOG_RATIO_CLAMP, VESPO_LOG_WEIGHT_MIN, LossConfig


def _where(condition, if_true, if_false):
    return torch.where(condition, if_true, if_false)


# --- values ---------------------------------------------------------------------------------


def clip_value(rho, advantage, logprob, weight, config: LossConfig):
    """-min(rho' A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho' = min(rho, delta); then
    bounded by -c A for A < 0 under dual clip."""
    capped = rho if config.option("delta") is None else rho.clamp(max=config.option("delta"))
    unclipped = -capped * advantage
    clipped = -rho.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * advantage
    loss = torch.maximum(unclipped, clipped)
    if config.option("dual_clip") is not None:
        loss = _where(advantage < 0, torch.minimum(loss, -config.option("dual_clip") * advantage), loss)
    return loss


def cispo_cap_value(rho, advantage, logprob, weight, config: LossConfig):
    """-sg[min(rho, ratio_cap)] A l."""
    return -rho.detach().clamp(max=config.option("ratio_cap")) * advantage * logprob


def cispo_clip_value(rho, advantage, logprob, weight, config: LossConfig):
    """-sg[clip(rho, 1 - eps_low, 1 + eps_high)] A l."""
    return -rho.detach().clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * advantage * logprob


def sapo_temperature(advantage, config: LossConfig):
    return _where(advantage > 0, torch.full_like(advantage, config.option("sapo_temperature_pos")),
                  torch.full_like(advantage, config.option("sapo_temperature_neg")))


def sapo_value(rho, advantage, logprob, weight, config: LossConfig):
    """-(4 / tau) sigmoid(tau (rho - 1)) A, tau = sapo_temperature_pos if A > 0 else _neg."""
    tau = sapo_temperature(advantage, config)
    return -(4.0 / tau) * torch.sigmoid(tau * (rho - 1.0)) * advantage


def gmpo_value(rho, advantage, logprob, weight, config: LossConfig):
    """-A rho, rho the response's geometric mean of clipped ratios (:func:`gmpo_log_ratio`)."""
    return -advantage * rho


def vespo_value(rho, advantage, logprob, weight, config: LossConfig):
    """-sg[phi] A l, phi the response's weight (:func:`vespo_weight`)."""
    return -weight.detach() * advantage * logprob


def gpg_value(rho, advantage, logprob, weight, config: LossConfig):
    """-A l."""
    return -advantage * logprob


VALUES = {
    "clip": clip_value,
    "cispo_cap": cispo_cap_value,
    "cispo_clip": cispo_clip_value,
    "sapo": sapo_value,
    "gmpo": gmpo_value,
    "vespo": vespo_value,
    "gpg": gpg_value,
}


# --- derivatives -----------------------------------------------------------------------------


def clip_slope(rho, advantage, logprob, weight, config: LossConfig):
    """torch.maximum passes its gradient to the larger branch, half to each at a tie: the
    unclipped branch's is -A where delta's cap passes it (rho <= delta), the clipped
    one's -A where the clamp does (rho on [1 - eps_low, 1 + eps_high]). At the dual-clip
    bound torch.minimum splits the gradient again: half passes."""
    low, high = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high
    delta = config.option("delta")
    capped = rho if delta is None else rho.clamp(max=delta)
    unclipped = -capped * advantage
    clipped = -rho.clamp(low, high) * advantage
    zero = torch.zeros_like(rho)
    through_unclipped = -advantage if delta is None else _where(rho <= delta, -advantage, zero)
    through_clipped = _where((rho >= low) & (rho <= high), -advantage, zero)
    d_ratio = _where(unclipped > clipped, through_unclipped,
                     _where(clipped > unclipped, through_clipped, 0.5 * (through_unclipped + through_clipped)))
    if config.option("dual_clip") is not None:
        objective = torch.maximum(unclipped, clipped)
        bound = -config.option("dual_clip") * advantage
        negative = advantage < 0
        d_ratio = _where(negative & (objective > bound), zero,
                         _where(negative & (objective == bound), 0.5 * d_ratio, d_ratio))
    return d_ratio, zero


def cispo_cap_slope(rho, advantage, logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -rho.clamp(max=config.option("ratio_cap")) * advantage


def cispo_clip_slope(rho, advantage, logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -rho.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * advantage


def sapo_slope(rho, advantage, logprob, weight, config: LossConfig):
    """d/drho of -(4 / tau) sigmoid(tau (rho - 1)) A = -4 sigma (1 - sigma) A."""
    sigma = torch.sigmoid(sapo_temperature(advantage, config) * (rho - 1.0))
    return -4.0 * sigma * (1.0 - sigma) * advantage, torch.zeros_like(rho)


def gmpo_slope(rho, advantage, logprob, weight, config: LossConfig):
    return -advantage, torch.zeros_like(rho)


def vespo_slope(rho, advantage, logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -weight * advantage


def gpg_slope(rho, advantage, logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -advantage


SLOPES = {
    "clip": clip_slope,
    "cispo_cap": cispo_cap_slope,
    "cispo_clip": cispo_clip_slope,
    "sapo": sapo_slope,
    "gmpo": gmpo_slope,
    "vespo": vespo_slope,
    "gpg": gpg_slope,
}


# --- the per-response steps ----------------------------------------------------------------


def gmpo_log_ratio(log_ratio, advantage, config: LossConfig):
    """A token's log-ratio clipped to [-eps_low, eps_high] on the side where A's sign
    makes it harmful (verl's geo_mean): above for A > 0, below for A < 0, 0 for A = 0.
    The response's ratio is exp of the mean over its tokens."""
    sign = torch.sign(advantage)
    clipped = log_ratio.clamp(-config.epsilon_low, config.epsilon_high)
    return sign * torch.minimum(sign * log_ratio, sign * clipped)


def vespo_weight(summed_log_ratio, advantage, config: LossConfig):
    """phi = w^k exp(lam (1 - w)), log w the response's summed (not mean) log-ratio
    clamped to [log 1e-8, LOG_RATIO_CLAMP], (k, lam) = (vespo_k_pos, vespo_lambda_pos)
    for A >= 0, else the _neg pair; 0 where it overflows (TRL's nan_to_num)."""
    log_w = summed_log_ratio.clamp(VESPO_LOG_WEIGHT_MIN, LOG_RATIO_CLAMP)
    nonnegative = advantage >= 0
    k = _where(nonnegative, torch.full_like(log_w, config.option("vespo_k_pos")),
               torch.full_like(log_w, config.option("vespo_k_neg")))
    lam = _where(nonnegative, torch.full_like(log_w, config.option("vespo_lambda_pos")),
                 torch.full_like(log_w, config.option("vespo_lambda_neg")))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)

assert set(VALUES) == set(SLOPES), "every objective declares its value and its derivative"
assert math.isfinite(VESPO_LOG_WEIGHT_MIN)
