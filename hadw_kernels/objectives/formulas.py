"""The policy objectives of ``objectives.table.OBJECTIVES`` (docs/math.md, section 5): each a
per-token loss to minimise, written once here as a function of the token's ratio rho,
its advantage A and its log-prob l, with its derivative.

``value`` is what the reference (reference/surrogate.py) differentiates; ``slope`` gives
(d value / d rho, d value / d l) as autograd does, the form the C++ and Triton kernels
transcribe (one branch per objective); tests/test_objectives.py holds every slope to
autograd's at random points and at the edges (ties, clip bounds). Quantities taken
through a stop-gradient (CISPO's clipped ratio, VESPO's weight) enter as constants.

VESPO's weight and GMPO's ratio need the whole response first: their rows' response step
(``objectives.table.RESPONSE_STEPS``) says which, and the row's ``response_formula`` is
its formula of it (:func:`gmpo_log_ratio`, :func:`vespo_weight`). Each row of
``objectives.table.OBJECTIVES`` holds its formulas: nothing here is keyed by a name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the formulas read a config; the config reads the objectives' rows, which hold them
    from ..config.loss_config import LossConfig

# rho = exp(clamp(log-ratio)): keeps exp finite for any policy drift.
LOG_RATIO_CLAMP = 20.0
# VESPO's summed log-ratio is clamped to [log 1e-8, LOG_RATIO_CLAMP] (TRL's bounds).
VESPO_LOG_WEIGHT_MIN = math.log(1e-8)


def _where(condition, if_true, if_false):
    return torch.where(condition, if_true, if_false)


# --- values ---------------------------------------------------------------------------------


def clip_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-min(rho' A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho' = min(rho, delta); then
    bounded by -c A for A < 0 under dual clip."""
    delta, dual_clip = config.option("delta"), config.option("dual_clip")
    capped = rho if delta is None else rho.clamp(max=delta)
    unclipped = -capped * advantage
    clipped = -rho.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * advantage
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = _where(advantage < 0, torch.minimum(loss, -dual_clip * advantage), loss)
    return loss


def cispo_cap_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-sg[min(rho, ratio_cap)] A l."""
    return -rho.detach().clamp(max=config.option_value("ratio_cap")) * advantage * logprob


def cispo_clip_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-sg[clip(rho, 1 - eps_low, 1 + eps_high)] A l."""
    return -rho.detach().clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * advantage * logprob


def sapo_temperature(advantage, config: LossConfig):
    return _where(advantage > 0, torch.full_like(advantage, config.option_value("sapo_temperature_pos")),
                  torch.full_like(advantage, config.option_value("sapo_temperature_neg")))


def sapo_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-(4 / tau) sigmoid(tau (rho - 1)) A, tau = sapo_temperature_pos if A > 0 else _neg."""
    tau = sapo_temperature(advantage, config)
    return -(4.0 / tau) * torch.sigmoid(tau * (rho - 1.0)) * advantage


def gmpo_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-A rho, rho the response's geometric mean of clipped ratios (:func:`gmpo_log_ratio`)."""
    return -advantage * rho


def vespo_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-sg[phi] A l, phi the response's weight (:func:`vespo_weight`)."""
    return -weight.detach() * advantage * logprob


def gpg_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-A l."""
    return -advantage * logprob


def dppo_moved_within(logprob, old_logprob, advantage, epsilon_low: float, epsilon_high: float, objective: str):
    """DPPO's stop-gradient mask (verl's valid_mask), as 0 or 1 in the log-probs' dtype:
    whether the token's probability p = exp(l) moved within the clip range in the direction
    its advantage favours, by p - p_old (``dppo_tv``) or by the binary KL of (p_old, p)
    (``dppo_kl``)."""
    prob, old_prob = torch.exp(logprob.detach()), torch.exp(old_logprob)
    if objective == "dppo_tv":
        up, down = (prob - old_prob) <= epsilon_high, (prob - old_prob) >= -epsilon_low
    else:  # +1e-8 in its log as verl's
        binary_kl = old_prob * (old_logprob - logprob.detach()) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        up = (binary_kl <= epsilon_high) | (prob <= old_prob)
        down = (binary_kl <= epsilon_low) | (prob >= old_prob)
    return _where(advantage > 0, up, down).to(logprob.dtype)


def _dppo_mask(logprob, old_logprob, advantage, config: LossConfig):
    return dppo_moved_within(logprob, old_logprob, advantage, config.epsilon_low, config.epsilon_high,
                             config.objective)


def dppo_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-sg[min(rho, ratio_cap)] A l sg[m], m whether p moved within the range on A's side
    (:func:`dppo_moved_within`; dppo_tv and dppo_kl differ in m alone)."""
    moved = _dppo_mask(logprob, old_logprob, advantage, config)
    return -rho.detach().clamp(max=config.option_value("ratio_cap")) * advantage * logprob * moved


def dro_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-(A l - dro_beta / 2 (l - l_old)^2)."""
    return -(logprob * advantage - 0.5 * config.option_value("dro_beta") * (logprob - old_logprob).square())


def clip_cov_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """clip_value times 1 - s, s the token's selection (:func:`clip_cov_selection`)."""
    return clip_value(rho, advantage, logprob, old_logprob, weight, config) * (1 - weight)


def kl_cov_value(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """-A rho + s ppo_kl_coef |l - l_old|, s the token's selection (:func:`kl_cov_selection`)."""
    return -advantage * rho + weight * config.option_value("ppo_kl_coef") * (logprob - old_logprob).abs()




# --- derivatives -----------------------------------------------------------------------------


def clip_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
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
    dual_clip = config.option("dual_clip")
    if dual_clip is not None:
        objective = torch.maximum(unclipped, clipped)
        bound = -dual_clip * advantage
        negative = advantage < 0
        d_ratio = _where(negative & (objective > bound), zero,
                         _where(negative & (objective == bound), 0.5 * d_ratio, d_ratio))
    return d_ratio, zero


def cispo_cap_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -rho.clamp(max=config.option_value("ratio_cap")) * advantage


def cispo_clip_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -rho.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * advantage


def sapo_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """d/drho of -(4 / tau) sigmoid(tau (rho - 1)) A = -4 sigma (1 - sigma) A."""
    sigma = torch.sigmoid(sapo_temperature(advantage, config) * (rho - 1.0))
    return -4.0 * sigma * (1.0 - sigma) * advantage, torch.zeros_like(rho)


def gmpo_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    return -advantage, torch.zeros_like(rho)


def vespo_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -weight * advantage


def gpg_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -advantage


def dppo_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    moved = _dppo_mask(logprob, old_logprob, advantage, config)
    return torch.zeros_like(rho), -rho.clamp(max=config.option_value("ratio_cap")) * advantage * moved


def dro_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    return torch.zeros_like(rho), -advantage + config.option_value("dro_beta") * (logprob - old_logprob)


def clip_cov_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    d_ratio, d_logprob = clip_slope(rho, advantage, logprob, old_logprob, weight, config)
    return d_ratio * (1 - weight), d_logprob


def kl_cov_slope(rho, advantage, logprob, old_logprob, weight, config: LossConfig):
    """|x|'s derivative is sign(x), 0 at 0 (autograd's)."""
    return -advantage, weight * config.option_value("ppo_kl_coef") * torch.sign(logprob - old_logprob)




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
    k = _where(nonnegative, torch.full_like(log_w, config.option_value("vespo_k_pos")),
               torch.full_like(log_w, config.option_value("vespo_k_neg")))
    lam = _where(nonnegative, torch.full_like(log_w, config.option_value("vespo_lambda_pos")),
                 torch.full_like(log_w, config.option_value("vespo_lambda_neg")))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)




def ppo_terms(ratio, advantage, epsilon_low: float, epsilon_high: float):
    """PPO's two loss terms (verl's pg_losses1 and pg_losses2): -A rho, -A clip(rho)."""
    return -advantage * ratio, -advantage * ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)


# --- the batch statistics that select tokens ------------------------------------------------
# An objective with a selection (its row's ``selection``) reads the whole call first: its
# selection [N] (bool) reaches every backend's kernels as each token's weight s (1: selected).
# Both read counts on the host, as verl's functions do: the number of tokens to select, and
# clip_cov the number of candidates its random draw permutes (docs/architecture.md).


def _covariance(advantage, logprobs, mask):
    """(A - mean A)(l - mean l) of each token, the means over the counted tokens as verl's
    masked_mean forms them (the sum over the count plus 1e-8)."""
    count = mask.sum() + 1e-8
    advantage_mean = torch.where(mask, advantage, torch.zeros_like(advantage)).sum() / count
    logprob_mean = torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum() / count
    return (advantage - advantage_mean) * (logprobs - logprob_mean)


@torch.no_grad()
def clip_cov_selection(logprobs, old_logprobs, advantage, mask, config: LossConfig, generator=None):
    """verl's clip_cov: max(1, floor(clip_cov_ratio N)) tokens drawn without replacement
    (``torch.randperm`` with ``generator``, None: the global one) among the counted tokens
    that PPO's clip leaves unclipped and whose covariance lies in (clip_cov_lb,
    clip_cov_ub), in token order; N the counted tokens."""
    ratio = torch.exp(logprobs - old_logprobs)  # unclamped, as verl's
    unclipped, clipped = ppo_terms(ratio, advantage, config.epsilon_low, config.epsilon_high)
    covariance = _covariance(advantage, logprobs, mask)
    candidates = mask & ~(clipped > unclipped) & (covariance > config.option_value("clip_cov_lb")) \
        & (covariance < config.option_value("clip_cov_ub"))
    positions = torch.nonzero(candidates).flatten()
    selected = torch.zeros_like(mask)
    if positions.numel() > 0:
        count = max(int(config.option_value("clip_cov_ratio") * int(mask.sum())), 1)
        # On the generator's device: the CPU by default (verl's draw), or the inputs'.
        on = None if generator is None else generator.device
        drawn = torch.randperm(positions.numel(), generator=generator, device=on)[:count].to(positions.device)
        selected[positions[drawn]] = True
    return selected


@torch.no_grad()
def kl_cov_selection(logprobs, old_logprobs, advantage, mask, config: LossConfig, generator=None):
    """verl's kl_cov: the max(1, floor(kl_cov_ratio N)) counted tokens of largest covariance
    (torch.topk), the means over the counted tokens."""
    positions = torch.nonzero(mask).flatten()
    selected = torch.zeros_like(mask)
    if positions.numel() > 0:
        valid_advantage, valid_logprobs = advantage[positions], logprobs[positions]
        covariance = (valid_advantage - valid_advantage.mean()) * (valid_logprobs - valid_logprobs.mean())
        count = max(1, int(positions.numel() * config.option_value("kl_cov_ratio")))
        selected[positions[torch.topk(covariance, count, largest=True).indices]] = True
    return selected
