"""The per-token math of the Triton surrogate kernels (docs/math.md, section 5), shared by
``surrogate.py``'s kernels and the gradients-in-forward linear kernels
(``linear_logprob.py``), as ``csrc/token_math.h`` is by the C++ ones.

``objective_terms`` transcribes objectives.py's values and derivatives, one branch per
objective (its code in objectives.table.OBJECTIVE_NAMES); ``response_log_ratio`` and
``response_weights`` its formula of its response step (its row's response_formula), one
branch per objective that has one; ``policy_term`` adds the ratio's chain rule,
``kl_term`` the KL estimators, ``aggregation_weight`` a token's weight by the aggregation
mode. All arithmetic is in the compute dtype of the caller's tensors.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..config.loss_config import K3_LOG_RATIO_CLAMP, K3_VALUE_CLAMP, KL_ESTIMATORS
from ..objectives.table import LOG_RATIO_CLAMP, OPTION_SLOTS, RATIO_LEVELS, VESPO_LOG_WEIGHT_MIN
from .codes import (
    OBJECTIVE_CISPO_CAP,
    OBJECTIVE_CISPO_CLIP,
    OBJECTIVE_CLIP,
    OBJECTIVE_CLIP_COV,
    OBJECTIVE_DPPO_KL,
    OBJECTIVE_DPPO_TV,
    OBJECTIVE_DRO,
    OBJECTIVE_GMPO,
    OBJECTIVE_GPG,
    OBJECTIVE_KL_COV,
    OBJECTIVE_SAPO,
    OBJECTIVE_VESPO,
    OPTION_DELTA,
    OPTION_DRO_BETA,
    OPTION_DUAL_CLIP,
    OPTION_PPO_KL_COEF,
    OPTION_RATIO_CAP,
    OPTION_SAPO_TEMPERATURE_NEG,
    OPTION_SAPO_TEMPERATURE_POS,
    OPTION_VESPO_K_NEG,
    OPTION_VESPO_K_POS,
    OPTION_VESPO_LAMBDA_NEG,
    OPTION_VESPO_LAMBDA_POS,
)

_KL_K1 = tl.constexpr(KL_ESTIMATORS.index("k1"))
_KL_K2 = tl.constexpr(KL_ESTIMATORS.index("k2"))
_KL_K3 = tl.constexpr(KL_ESTIMATORS.index("k3"))

# The ratio forms (objectives.table.RATIO_LEVELS) by their codes.
TOKEN_RATIO = tl.constexpr(RATIO_LEVELS.index("token"))
SEQUENCE_RATIO = tl.constexpr(RATIO_LEVELS.index("sequence"))

# The objectives' codes and their options' indices in the option vector (OPTION_<NAME>)
# are codes.py's. The kernels take the vector as OPTION_SLOTS fp64 scalars, option_0 ...
# option_3 (objectives.table.OPTION_SLOTS says why; a row with more options is refused
# there), and objective_option_values gathers them.

LOG_RATIO_LIMIT = tl.constexpr(LOG_RATIO_CLAMP)
_VESPO_LOG_WEIGHT_MIN = tl.constexpr(VESPO_LOG_WEIGHT_MIN)
_K3_LOG_RATIO_CLAMP = tl.constexpr(K3_LOG_RATIO_CLAMP)
_K3_VALUE_CLAMP = tl.constexpr(K3_VALUE_CLAMP)


# Triton's interpreter casts fp32 to bf16 by truncation; GPUs (and eager PyTorch) round
# to nearest even. Under the interpreter, kernels that store bf16 round by hand first.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_to_bfloat16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))



@triton.jit
def sign(x):
    # sgn(0) = 0 (docs/math.md, section 4): Phi of a zero advantage is lambda_scale; sgn(NaN) = 0
    # as torch.sign.
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0)).to(x.dtype)


@triton.jit
def clamp(x, low, high):
    """clamp that keeps NaN (tl.minimum / tl.maximum drop it by default)."""
    return tl.minimum(tl.maximum(x, low, propagate_nan=tl.PropagateNan.ALL), high, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def exp_minus_one_minus_x(x):
    """exp(x) - 1 - x without the cancellation of the literal formula near 0.

    Below |x| = 1/2 the Taylor series to x^12 (truncation < 2e-13 relative); above it
    the literal formula loses at most about 20 ulp. libdevice's expm1 is unavailable under
    the interpreter, and the literal formula would lose all digits of an on-policy
    log-ratio's k3 (~1e-7) in float32.
    """
    series = 1.0 / 479001600.0
    series = series * x + 1.0 / 39916800.0
    series = series * x + 1.0 / 3628800.0
    series = series * x + 1.0 / 362880.0
    series = series * x + 1.0 / 40320.0
    series = series * x + 1.0 / 5040.0
    series = series * x + 1.0 / 720.0
    series = series * x + 1.0 / 120.0
    series = series * x + 1.0 / 24.0
    series = series * x + 1.0 / 6.0
    series = series * x + 0.5
    small = x * x * series
    return tl.where(tl.abs(x) < 0.5, small, tl.exp(x) - 1.0 - x)


@triton.jit
def token_ratio(log_ratio):
    """(rho, whether the clamp passes the gradient): rho = exp(log-ratio clamped to
    +-LOG_RATIO_CLAMP); the clamp passes on the closed interval only (NaN: none), as
    torch.clamp."""
    passes = (log_ratio >= -LOG_RATIO_LIMIT) & (log_ratio <= LOG_RATIO_LIMIT)
    return tl.exp(clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)), passes


def option_slots(vector) -> dict:
    """An option vector (LossConfig.objective_options) as the kernels' OPTION_SLOTS fp64
    option arguments, unread slots 0."""
    padded = [float(value) for value in vector] + [0.0] * (OPTION_SLOTS - len(vector))
    return {f"option_{slot}": padded[slot] for slot in range(OPTION_SLOTS)}


@triton.jit
def objective_option_values(option_0, option_1, option_2, option_3, dtype: tl.constexpr):
    """The option vector in the compute dtype, indexed by the OPTION_<NAME> constants."""
    return (tl.full([], option_0, dtype), tl.full([], option_1, dtype), tl.full([], option_2, dtype),
            tl.full([], option_3, dtype))


@triton.jit
def clip_objective(ratio, advantage, ratio_low, ratio_high, delta, dual_clip):
    """objectives.clip_value and clip_slope: -min(rho' A, clip(rho) A), rho' = min(rho,
    delta), bounded by -c A for A < 0 under dual clip (each off at +inf), and its
    derivative with respect to rho as autograd gives it for the reference: the larger
    branch passes its gradient, half each at a tie; the unclipped branch's is -A where
    delta's cap passes it (rho <= delta), the clipped one's -A where the clamp does (rho on
    [low, high]); at the dual-clip bound torch.minimum splits the gradient, so half passes."""
    # Blocks, not scalars, on either side of `|` and `&`: the interpreter turns a scalar
    # boolean into float32 when broadcasting it.
    delta = tl.zeros(ratio.shape, ratio.dtype) + delta
    dual_clip = tl.zeros(ratio.shape, ratio.dtype) + dual_clip
    capped = tl.minimum(ratio, delta, propagate_nan=tl.PropagateNan.ALL)
    through_unclipped = tl.where((delta == float("inf")) | (ratio <= delta), -advantage, 0.0)
    unclipped = -capped * advantage
    clipped = -clamp(ratio, ratio_low, ratio_high) * advantage
    through_clipped = tl.where((ratio >= ratio_low) & (ratio <= ratio_high), -advantage, 0.0)
    slope = tl.where(unclipped > clipped, through_unclipped,
                     tl.where(clipped > unclipped, through_clipped, 0.5 * (through_unclipped + through_clipped)))
    objective = tl.maximum(unclipped, clipped, propagate_nan=tl.PropagateNan.ALL)
    bounded = (dual_clip != float("inf")) & (advantage < 0)
    # c = 0 where the bound is off: an infinite c times a zero advantage would be NaN, which
    # no lane reads but the interpreter warns of.
    bound = -tl.where(bounded, dual_clip, tl.zeros_like(dual_clip)) * advantage
    slope = tl.where(bounded & (objective > bound), 0.0, tl.where(bounded & (objective == bound), 0.5 * slope, slope))
    objective = tl.where(bounded, tl.minimum(objective, bound, propagate_nan=tl.PropagateNan.ALL), objective)
    return objective, slope


@triton.jit
def dppo_moved_within(logprob, old_logprob, advantage, epsilon_low, epsilon_high, TOTAL_VARIATION: tl.constexpr):
    """objectives.dppo_moved_within: whether the token's probability moved within the
    range in the direction its advantage favours, by p - p_old (TOTAL_VARIATION) or by the
    binary KL of (p_old, p) (the log's +1e-8 as verl's)."""
    prob = tl.exp(logprob)
    old_prob = tl.exp(old_logprob)
    if TOTAL_VARIATION:
        up = (prob - old_prob) <= epsilon_high
        down = (prob - old_prob) >= -epsilon_low
    else:
        # 1e-8 as a value of the compute dtype: a bare constant would be rounded to float32.
        tiny = tl.full(prob.shape, 1e-8, prob.dtype)
        binary_kl = old_prob * (old_logprob - logprob) + (1.0 - old_prob) * tl.log(
            (1.0 - old_prob + tiny) / (1.0 - prob + tiny))
        up = (binary_kl <= epsilon_high) | (prob <= old_prob)
        down = (binary_kl <= epsilon_low) | (prob >= old_prob)
    return tl.where(advantage > 0, up, down)


@triton.jit
def objective_terms(ratio, advantage, logprob, old_logprob, weight, ratio_low, ratio_high, epsilon_low, epsilon_high,
                    options, OBJECTIVE: tl.constexpr):
    """(l, d l / d rho, d l / d logp) of a token: its row's value and slope, one
    branch per objective (docs/math.md, section 5). ``ratio`` is the token's rho in its
    ratio form (GMPO: the response's geometric mean of clipped ratios), ``logprob`` and
    ``old_logprob`` its log-probs (read only by the objectives that weigh them), ``weight``
    the objective's per-token weight (VESPO's phi; the selection, 0 or 1, of an objective
    that selects tokens), ``options`` the option vector (objective_option_values). Ratios
    taken through a stop-gradient (CISPO's, VESPO's weight, DPPO's) pass no gradient to rho."""
    zero = tl.zeros(ratio.shape, ratio.dtype)
    if OBJECTIVE == OBJECTIVE_CLIP:
        objective, d_ratio = clip_objective(ratio, advantage, ratio_low, ratio_high, options[OPTION_DELTA],
                                            options[OPTION_DUAL_CLIP])
        d_logprob = zero
    elif OBJECTIVE == OBJECTIVE_CISPO_CAP:
        d_ratio = zero
        d_logprob = -tl.minimum(ratio, options[OPTION_RATIO_CAP], propagate_nan=tl.PropagateNan.ALL) * advantage
        objective = d_logprob * logprob
    elif OBJECTIVE == OBJECTIVE_CISPO_CLIP:
        d_ratio = zero
        d_logprob = -clamp(ratio, ratio_low, ratio_high) * advantage
        objective = d_logprob * logprob
    elif OBJECTIVE == OBJECTIVE_SAPO:
        temperature = tl.where(advantage > 0, options[OPTION_SAPO_TEMPERATURE_POS],
                               options[OPTION_SAPO_TEMPERATURE_NEG])
        gate = tl.sigmoid(temperature * (ratio - 1.0))
        objective = -(4.0 / temperature) * gate * advantage
        d_ratio = -4.0 * gate * (1.0 - gate) * advantage
        d_logprob = zero
    elif OBJECTIVE == OBJECTIVE_GMPO:
        objective = -advantage * ratio
        d_ratio = -advantage
        d_logprob = zero
    elif OBJECTIVE == OBJECTIVE_VESPO:
        d_ratio = zero
        d_logprob = -weight * advantage
        objective = d_logprob * logprob
    elif OBJECTIVE == OBJECTIVE_GPG:
        d_ratio = zero
        d_logprob = -advantage
        objective = d_logprob * logprob
    elif (OBJECTIVE == OBJECTIVE_DPPO_TV) or (OBJECTIVE == OBJECTIVE_DPPO_KL):
        moved = dppo_moved_within(logprob, old_logprob, advantage, epsilon_low, epsilon_high,
                                  OBJECTIVE == OBJECTIVE_DPPO_TV)
        d_ratio = zero
        # Times the mask, not selected by it: a NaN (a NaN input) stays NaN, as the reference's.
        d_logprob = -tl.minimum(ratio, options[OPTION_RATIO_CAP], propagate_nan=tl.PropagateNan.ALL) * advantage \
            * moved.to(ratio.dtype)
        objective = d_logprob * logprob
    elif OBJECTIVE == OBJECTIVE_DRO:
        beta = options[OPTION_DRO_BETA]
        log_ratio = logprob - old_logprob
        objective = -(logprob * advantage - 0.5 * beta * (log_ratio * log_ratio))
        d_ratio = zero
        d_logprob = -advantage + beta * log_ratio
    elif OBJECTIVE == OBJECTIVE_CLIP_COV:
        off = zero + float("inf")  # no delta, no dual clip
        objective, d_ratio = clip_objective(ratio, advantage, ratio_low, ratio_high, off, off)
        objective = objective * (1.0 - weight)
        d_ratio = d_ratio * (1.0 - weight)
        d_logprob = zero
    else:
        tl.static_assert(OBJECTIVE == OBJECTIVE_KL_COV, "an objective of OBJECTIVE_NAMES without a branch here")
        penalty = weight * options[OPTION_PPO_KL_COEF]
        log_ratio = logprob - old_logprob
        objective = -advantage * ratio + penalty * tl.abs(log_ratio)
        d_ratio = -advantage
        d_logprob = penalty * sign(log_ratio)
    return objective, d_ratio, d_logprob


@triton.jit
def policy_term(ratio, ratio_passes, advantage, logprob, old_logprob, weight, ratio_low, ratio_high, epsilon_low,
                epsilon_high, options, OBJECTIVE: tl.constexpr):
    """(l, d l / d logp) of a token whose ratio's gradient goes through its own log-prob
    (the token and gspo_token forms): d rho / d logp = rho where the log-ratio's clamp
    passes (``ratio_passes``), else 0 (docs/math.md, section 5)."""
    objective, d_ratio, d_logprob = objective_terms(ratio, advantage, logprob, old_logprob, weight, ratio_low,
                                                    ratio_high, epsilon_low, epsilon_high, options, OBJECTIVE)
    return objective, tl.where(ratio_passes, d_ratio * ratio, 0.0) + d_logprob


@triton.jit
def response_log_ratio(log_ratio, advantage, epsilon_low, epsilon_high, OBJECTIVE: tl.constexpr):
    """(a token's log-ratio as its response's mean takes it, whether that passes the
    log-ratio's gradient) of an objective whose response step is clipped_log_ratio_mean:
    the row's response_formula, one branch per objective; the gradient passes as autograd
    gives it for the reference, ties included."""
    if OBJECTIVE == OBJECTIVE_GMPO:
        # objectives.gmpo_log_ratio: clipped to [-eps_low, eps_high] on the side A's sign
        # makes harmful (above for A > 0, below for A < 0; 0 for A = 0).
        direction = sign(advantage)
        clipped = clamp(log_ratio, -epsilon_low, epsilon_high)
        value = direction * tl.minimum(direction * log_ratio, direction * clipped, propagate_nan=tl.PropagateNan.ALL)
        passes = ((advantage > 0) & (log_ratio <= epsilon_high)) | ((advantage < 0) & (log_ratio >= -epsilon_low))
    else:
        tl.static_assert(False, "an objective whose response step is clipped_log_ratio_mean without a branch here")
    return value, passes


@triton.jit
def response_weights(summed_log_ratio, options, OBJECTIVE: tl.constexpr):
    """(the weight of the tokens with A >= 0, of those with A < 0) from their response's
    sum of clamped log-ratios, of an objective whose response step is log_ratio_sum:
    the row's response_formula, one branch per objective."""
    if OBJECTIVE == OBJECTIVE_VESPO:
        nonnegative = vespo_weight(summed_log_ratio, options[OPTION_VESPO_K_POS], options[OPTION_VESPO_LAMBDA_POS])
        negative = vespo_weight(summed_log_ratio, options[OPTION_VESPO_K_NEG], options[OPTION_VESPO_LAMBDA_NEG])
    else:
        tl.static_assert(False, "an objective whose response step is log_ratio_sum without a branch here")
    return nonnegative, negative


@triton.jit
def vespo_weight(summed_log_ratio, k, lam):
    """objectives.vespo_weight for one sign's (k, lam): phi = w^k exp(lam (1 - w)), log w
    the response's summed log-ratio clamped to [log 1e-8, LOG_RATIO_CLAMP]; 0 where phi
    is not finite (TRL's nan_to_num)."""
    # The lower bound log(1e-8) is no float32 number: as a bare constant Triton would round
    # it to one and clamp float64 sums off by that rounding (docs/architecture.md,
    # "Numerics").
    lowest = tl.full(summed_log_ratio.shape, _VESPO_LOG_WEIGHT_MIN, summed_log_ratio.dtype)
    log_weight = clamp(summed_log_ratio, lowest, LOG_RATIO_LIMIT)
    phi = tl.exp(lam + k * log_weight - lam * tl.exp(log_weight))
    return tl.where(tl.abs(phi) < float("inf"), phi, 0.0)


@triton.jit
def kl_term(logprobs, ref, ESTIMATOR: tl.constexpr):
    """(KL estimate, its derivative with respect to logp) of one token
    (config.KL_ESTIMATORS, with verl's clamps for k3)."""
    log_ratio = logprobs - ref
    if ESTIMATOR == _KL_K1:
        value = log_ratio
        slope = tl.full(log_ratio.shape, 1.0, log_ratio.dtype)
    elif ESTIMATOR == _KL_K2:
        value = 0.5 * log_ratio * log_ratio
        slope = log_ratio
    elif ESTIMATOR == _KL_K3:
        ref_delta = -log_ratio
        delta_in = (ref_delta >= -_K3_LOG_RATIO_CLAMP) & (ref_delta <= _K3_LOG_RATIO_CLAMP)
        ref_delta = clamp(ref_delta, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
        raw = exp_minus_one_minus_x(ref_delta)
        value_in = (raw >= -_K3_VALUE_CLAMP) & (raw <= _K3_VALUE_CLAMP)
        value = clamp(raw, -_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)
        # d/dlogp (exp(d) - 1 - d) with d = ref - logp: -(exp(d) - 1) = -(raw + d)
        slope = tl.where(delta_in & value_in, -(raw + ref_delta), 0.0)
    else:
        value = tl.abs(log_ratio)
        slope = sign(log_ratio)
    return value, slope


@triton.jit
def aggregation_weight(length, denominator, PER_RESPONSE_MEAN: tl.constexpr):
    """w of a valid token (aggregation.agg_weights): 1 / (T_i * denominator) for
    seq-mean-token-mean, else 1 / denominator (set by ``surrogate.aggregation`` on the
    host; 1 for token-mean without a normaliser, whose 1 / N_tok is the op's grad_scale)."""
    if PER_RESPONSE_MEAN:
        weight = 1.0 / (tl.maximum(length, 1).to(denominator.dtype) * denominator)
    else:
        weight = 1.0 / denominator
    return weight


