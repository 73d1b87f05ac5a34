"""What a loss is: the one description every implementation takes its constants from.

A loss type (``grpo``, ``dapo``, ``gspo``, ``dr_grpo``) is a preset of four choices
(:data:`LOSS_PRESETS`): whether the advantage is divided by the group's std, how
per-token values are aggregated into the batch loss (verl's ``loss_agg_mode``), whether
the importance ratio is per token or per sequence, and the clip range. Every choice can
be overridden one by one; :class:`LossConfig` holds the resolved values, and the
reference (``reference/surrogate.py``), the Triton kernels and the C++ kernels receive those
values, never the loss type's name. The C++ build generates its constants from this
module (``setup.py``), so the metric order and the option codes exist once.
"""

from __future__ import annotations

import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import TypedDict


@dataclass(frozen=True)
class Aggregation:
    """How an aggregation mode turns per-token values v of valid tokens into the loss:
    sum_i w_i sum_t v_it, with each valid token of response i weighed

        w_i = 1 / (count x (T_i if per_response_mean) x (L if times_max_length))

    ``count`` names the call's own count that a ``loss_normalizer`` replaces by the
    whole rollout batch's: "tokens" (N, the valid tokens), "responses" (S, the rows),
    or "one" (1: no count; a normaliser still divides). T_i is response i's valid
    tokens (at least 1), L the constant max_response_length (default: the mask width).
    Every backend reads this table (docs/math.md, section 5b)."""

    count: str
    per_response_mean: bool = False
    times_max_length: bool = False

    def __post_init__(self) -> None:
        if self.count not in AGGREGATION_COUNTS:
            raise ValueError(f"an aggregation counts one of {AGGREGATION_COUNTS}, got {self.count!r}")


AGGREGATION_COUNTS = ("tokens", "responses", "one")
AGGREGATIONS = {
    "token-mean": Aggregation(count="tokens"),  # DAPO, TRL's bnpo/dapo
    "seq-mean-token-mean": Aggregation(count="responses", per_response_mean=True),  # GRPO
    "seq-mean-token-sum": Aggregation(count="responses"),
    "seq-mean-token-sum-norm": Aggregation(count="responses", times_max_length=True),  # Dr.GRPO
    "token-sum": Aggregation(count="one"),  # verl's token-sum
}
AGG_MODES = tuple(AGGREGATIONS)

# KL(pi || pi_ref) estimators from the token log-probs, as verl's kl_penalty (k3 is its
# low_var_kl, with its clamps): x = logp - ref.
#   k1: x    k2: x^2 / 2    k3: clamp(exp(-x') - 1 + x', -10, 10), x' = clamp(x, -20, 20)    abs: |x|
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0
# The ratio that weighs the bias-corrected KL: the objective's own (its ratio form), or each
# token's exp(l - l_old) whatever the objective's form (TRL's at importance_sampling_level
# "token", where its VESPO's ratio is per response). docs/math.md, section 5d.
KL_BIAS_RATIOS = ("objective", "token")
# The dtype the entropy mask reads the entropies in (their quantile and the comparison with
# it): their own, fp32 at least, so that a token at the quantile compares equal to it and is
# kept; or float32 whatever their dtype, as TRL's trainer, whose LM head forms float32
# entropies for a float64 model too. docs/math.md, section 5d.
ENTROPY_MASK_DTYPES = ("entropy", "float32")

# The metrics every implementation returns, in this order (kernels index them by name).
METRIC_NAMES = (
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "approx_kl",
    "phi_mean",
    "zero_std_frac",
    "ref_kl",
    "entropy_mean",
)
# The metrics of the rollout correction and token masks (correction.py), after the
# kernels' in a loss's metrics, each present when its rule is on: the rollout weights' mean
# (after the rule, before batch normalisation), the shares of counted tokens whose weight
# the rule changed, that the rejection filters removed, that the off-policy and entropy
# masks zeroed, and that the objective's batch statistic selected (OBJECTIVES' selects_tokens).
CORRECTION_METRIC_NAMES = (
    "rollout_is_mean",
    "rollout_is_corrected_frac",
    "rollout_rejected_frac",
    "off_policy_masked_frac",
    "entropy_masked_frac",
    "selected_frac",
)


def ordered_metrics(metrics: dict) -> dict:
    """The metrics a call returns: those present, in the order METRIC_NAMES then
    CORRECTION_METRIC_NAMES give (every loss and the reference return them so)."""
    return {name: metrics[name] for name in METRIC_NAMES + CORRECTION_METRIC_NAMES if name in metrics}


# Metrics that describe the groups: unknown when the advantages come from the caller.
GROUP_METRICS = ("phi_mean", "zero_std_frac")
# What each metric is a mean over: "tokens" (the valid tokens), "ratios" (the importance
# ratios: the valid tokens, or at sequence level the responses with a valid token),
# "responses" or "groups". Calls that share a batch (micro-batches) combine a metric by
# weighing each call's value by its count, not by averaging the values.
METRIC_MEAN_OVER = {
    "clip_frac_low": "ratios",
    "clip_frac_high": "ratios",
    "ratio_mean": "ratios",
    "approx_kl": "tokens",
    "phi_mean": "responses",
    "zero_std_frac": "groups",
    "ref_kl": "tokens",
    "entropy_mean": "tokens",
    **{name: "tokens" for name in CORRECTION_METRIC_NAMES},
}

# How the linear loss forms its gradients (loss.fused_linear_hadw_grpo_loss).
LINEAR_PATHS = ("auto", "gradients_in_forward", "recompute")

IGNORE_INDEX = -100
DEFAULT_STD_EPS = 1e-6
DEFAULT_LAMBDA_SCALE = 1.3  # the paper's best value (Table 7)
AUTHORS_LAMBDA_SCALE = 1.5  # the authors' public code
# rho = exp(clamp(log-ratio)): keeps exp finite for any policy drift.
LOG_RATIO_CLAMP = 20.0
# VESPO's summed log-ratio is clamped to [log 1e-8, LOG_RATIO_CLAMP] (TRL's bounds).
VESPO_LOG_WEIGHT_MIN = math.log(1e-8)

# The linear loss holds the logits of ``block_rows`` rows at once, a [block_rows, V]
# buffer. By default the rows are split into even blocks of at most the device's
# buffer bytes and rows, a multiple of its row granule. CUDA (Triton): 1 GiB, where an
# H100's block GEMMs run at full speed (docs/gpu-report.md). CPU (the C++ kernels, which
# compile these values in through the generated header; Triton's interpreter uses them
# too): 640 MiB and at most 1024 rows, since grad_W's GEMM reduces over a block's rows
# and grad_W is read and written once per block, so fewer rows ran slower (measured in
# docs/cpp-backend.md, "Linear kernels").
LOGITS_BUFFER_BYTES = {"cuda": 1 << 30, "cpu": 640 << 20}
MAX_BLOCK_ROWS = {"cuda": 1 << 30, "cpu": 1024}
BLOCK_ROWS_GRANULE = {"cuda": 16, "cpu": 64}


def head_accumulator_bytes(vocab: int, hidden: int, element_size: int) -> int:
    """The fp32 accumulator of a 16-bit LM head's gradient over several blocks (rounded
    once at the end, as eager's single GEMM over every row is); none for fp32/fp64."""
    return 4 * vocab * hidden if element_size < 4 else 0


def block_rows_for(rows: int, vocab: int, element_size: int, device_type: str, requested: int | None = None,
                   accumulator_bytes: int = 0) -> int:
    """Rows per block of the linear loss: ``requested``, or the rows split into even
    blocks within the device's LOGITS_BUFFER_BYTES and MAX_BLOCK_ROWS (blocks of at most
    3533 rows for 8192 run as 3 x 2736, not 3533 + 3533 + 1126), a multiple of its
    BLOCK_ROWS_GRANULE. ``element_size`` is that of the buffer's dtype.

    ``accumulator_bytes`` (``head_accumulator_bytes``) is what several blocks would add:
    when all rows' logits fit in the budget plus that, they are one block, which holds no
    more memory and spares the accumulator's passes (on an H100 at the Qwen3-4B head,
    8192 bf16 rows: one block instead of three, docs/gpu-report.md)."""
    if requested:
        return requested
    device = device_type if device_type in LOGITS_BUFFER_BYTES else "cpu"
    granule = BLOCK_ROWS_GRANULE[device]
    budget = LOGITS_BUFFER_BYTES[device]
    if rows <= MAX_BLOCK_ROWS[device] and rows * vocab * element_size <= budget + accumulator_bytes:
        blocks = 1
    else:
        by_budget = budget // max(vocab * element_size, 1)
        largest = max(granule, min(MAX_BLOCK_ROWS[device], by_budget) // granule * granule)
        blocks = max(1, -(-rows // largest))
    even = -(-rows // blocks)
    return max(granule, -(-even // granule) * granule)


# How the importance ratio of a token is formed (docs/math.md, section 5):
#   token       rho_t = exp(l_t - lo_t)
#   sequence    rho_t = s_i = exp(mean over the response's tokens of l - lo), the gradient
#               reaching every token of the response through s_i (TRL's "sequence")
#   gspo_token  rho_t = sg[s_i] exp(l_t - sg[l_t]): s_i's value, the gradient through the
#               token's own log-prob (verl's gspo, TRL's "sequence_token")
# The two sequence forms give the same loss and gradient unless per-token importance
# weights differ within a response.
RATIO_LEVELS = ("token", "sequence", "gspo_token")


# How an objective's gradient reaches a token's log-prob (objectives.SLOPES gives it):
# "ratio": through its ratio alone (d loss / d logp = 0; in a sequence ratio form the
# slopes are summed over the response); "detached_weight": a stop-gradient weight times
# the log-prob (d loss / d rho = 0; its value's numerical derivative is not its gradient);
# "log_prob": the log-prob itself, no ratio; "ratio_and_log_prob": both (a token form).
GRADIENT_ROUTES = ("ratio", "detached_weight", "log_prob", "ratio_and_log_prob")


@dataclass(frozen=True)
class Objective:
    """A policy objective: the per-token loss to minimise as a function of the token's
    ratio rho, its advantage A and its log-prob l (docs/math.md, section 5; the formulas
    and their derivatives are ``objectives.py``'s, the kernels' one branch each).

    ``options``: the LossConfig fields that objectives alone read (an option some share sits
    at one index of each one's vector), in the order of its option vector, with their
    defaults (a None field takes the default; set on an objective that does not read it,
    it is refused; a None default means off, or, as ``dro_beta``'s, required). The kernels take the resolved
    values as one vector (:meth:`LossConfig.objective_options`, an option that is off as
    +inf: no bound) and read them by the index constants generated from this table
    (:data:`OPTION_INDEX`; ``kOption<Name>`` in C++, ``OPTION_<NAME>`` in Triton).
    ``ratio_levels``: the ratio forms it takes (RATIO_LEVELS), the first its default.
    ``gradient``: how its gradient reaches the log-prob (GRADIENT_ROUTES); the kernels
    branch on it.
    ``selects_tokens``: whether it reads a batch statistic that selects tokens before the
    kernels run (``objectives.SELECTIONS``; the kernels receive the selection per token)."""

    options: dict
    gradient: str
    ratio_levels: tuple[str, ...] = RATIO_LEVELS
    selects_tokens: bool = False

    @property
    def through_ratio(self) -> bool:
        return self.gradient in ("ratio", "ratio_and_log_prob")


OBJECTIVES = {
    # PPO's clip: -min(rho' A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho' = min(rho, delta)
    # (TRL's two-sided clip), then min(., -c A) for A < 0 (dual clip, c = dual_clip).
    "clip": Objective(options={"dual_clip": None, "delta": None}, gradient="ratio"),
    # CISPO as TRL defines it: -sg[min(rho, ratio_cap)] A l, an absolute cap (TRL's
    # epsilon_high; the ScaleRL paper's 5).
    "cispo_cap": Objective(options={"ratio_cap": 5.0}, gradient="detached_weight"),
    # CISPO as verl defines it: -sg[clip(rho, 1 - eps_low, 1 + eps_high)] A l.
    "cispo_clip": Objective(options={}, gradient="detached_weight"),
    # SAPO: -(4 / tau) sigmoid(tau (rho - 1)) A, tau by the sign of A.
    "sapo": Objective(options={"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}, gradient="ratio"),
    # GMPO (verl's geo_mean): -A exp(mean over the response of l - lo clipped in log space
    # to [-eps_low, eps_high] on the side A's sign makes harmful).
    "gmpo": Objective(options={}, gradient="ratio", ratio_levels=("sequence",)),
    # VESPO (TRL): -sg[phi] A l, phi = w^k exp(lam (1 - w)), w the response's summed ratio,
    # (k, lam) by the sign of A.
    "vespo": Objective(options={"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
                                "vespo_lambda_neg": 2.0}, gradient="detached_weight", ratio_levels=("sequence",)),
    # GPG (verl): -A l, no ratio.
    "gpg": Objective(options={}, gradient="log_prob", ratio_levels=("token",)),
    # DPPO (verl's dppo_tv, dppo_kl): -sg[min(rho, ratio_cap)] A l on the tokens whose
    # probability moved within the clip range, now a divergence bound, in the direction A's
    # sign favours (A > 0: up by at most epsilon_high; else down by at most epsilon_low):
    # p - p_old (tv), or the binary KL of (p_old, p) (kl); the other tokens give 0.
    "dppo_tv": Objective(options={"ratio_cap": 20.0}, gradient="detached_weight", ratio_levels=("token",)),
    "dppo_kl": Objective(options={"ratio_cap": 20.0}, gradient="detached_weight", ratio_levels=("token",)),
    # DRO (verl): -(A l - dro_beta / 2 (l - l_old)^2); dro_beta has no default.
    "dro": Objective(options={"dro_beta": None}, gradient="log_prob", ratio_levels=("token",)),
    # Clip-Cov (verl): PPO's clip, 0 on max(1, floor(clip_cov_ratio N)) tokens drawn at random
    # among the unclipped ones whose (A - mean A)(l - mean l) lies in (clip_cov_lb, clip_cov_ub).
    "clip_cov": Objective(options={"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
                          gradient="ratio", ratio_levels=("token",), selects_tokens=True),
    # KL-Cov (verl): -A rho, plus ppo_kl_coef |l - l_old| on the max(1, floor(kl_cov_ratio N))
    # tokens of largest (A - mean A)(l - mean l).
    "kl_cov": Objective(options={"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}, gradient="ratio_and_log_prob",
                        ratio_levels=("token",), selects_tokens=True),
}
assert all(objective.gradient in GRADIENT_ROUTES for objective in OBJECTIVES.values())
OBJECTIVE_NAMES = tuple(OBJECTIVES)
# Every objective-only option, with the objectives that read it.
OBJECTIVE_OPTIONS = {option: tuple(name for name, objective in OBJECTIVES.items() if option in objective.options)
                     for objective in OBJECTIVES.values() for option in objective.options}
# Each option's index in its objectives' option vectors (the same in every objective that
# reads it), and the longest vector: the kernels' fixed number of option slots.
OPTION_INDEX = {option: list(OBJECTIVES[owners[0]].options).index(option)
                for option, owners in OBJECTIVE_OPTIONS.items()}
assert all(list(OBJECTIVES[owner].options).index(option) == OPTION_INDEX[option]
           for option, owners in OBJECTIVE_OPTIONS.items() for owner in owners), \
    "an option shared by objectives sits at the same index of each one's vector"
OBJECTIVE_OPTION_SLOTS = max(len(objective.options) for objective in OBJECTIVES.values())


# Rollout correction (docs/math.md, section 5d; correction.py computes it). A rollout
# weight w = exp(l_old - l_rollout) is formed per token or per response (exp of the summed
# log ratio), and a rule bounds it: "truncate" clamps w into [lower, upper], "mask" sets it
# to 0 outside (the token stays counted).
CORRECTION_LEVELS = ("token", "sequence")
CORRECTION_RULES = ("truncate", "mask")
# verl's rejection filters "<where>_<statistic>": the statistic of a token's log ratio
# x = l_old - l_rollout (k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x), read per token or
# reduced over each response's tokens. True: its bounds are ratios, two-sided, compared on
# the log scale (k1); False: an upper bound on the statistic only.
REJECTION_STATISTICS = {"k1": True, "k2": False, "k3": False}
REJECTION_REDUCTIONS = {
    "token": None,
    "seq_sum": "sum",
    "seq_mean": "mean",
    "seq_max": "max",
}
# seq_max_k1 is not one of verl's: k1 takes both signs.
REJECTION_FILTERS = tuple(f"{where}_{statistic}" for where in REJECTION_REDUCTIONS for statistic in REJECTION_STATISTICS
                          if not (where == "seq_max" and statistic == "k1"))


@dataclass(frozen=True)
class RejectionFilter:
    """Removes from the loss the tokens (``token_*``) or whole responses (``seq_*``) whose
    statistic falls outside [lower, upper]: verl's ``rollout_rs`` option ``name`` with its
    ``rollout_rs_threshold``. For k1 the bounds are ratios (lower defaults to 1 / upper);
    k2 and k3 take an upper bound only. The tokens removed leave the loss's counts too."""

    name: str
    upper: float
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.name not in REJECTION_FILTERS:
            raise ValueError(f"unknown rejection filter {self.name!r}; expected one of {REJECTION_FILTERS}")
        check_finite_positive(f"rejection filter {self.name!r}'s upper bound", self.upper)
        if REJECTION_STATISTICS[self.statistic]:
            if self.lower is None:
                object.__setattr__(self, "lower", 1.0 / self.upper)
            check_finite_positive(f"rejection filter {self.name!r}'s lower bound", self.lower)
            if self.lower > self.upper:
                raise ValueError(f"rejection filter {self.name!r}: lower bound {self.lower} above upper {self.upper}")
        elif self.lower is not None:
            raise ValueError(f"rejection filter {self.name!r} takes an upper bound only ({self.statistic} >= 0), "
                             f"got lower={self.lower}")

    @property
    def reduction(self) -> str | None:
        return REJECTION_REDUCTIONS[self.name.rsplit("_", 1)[0]]

    @property
    def statistic(self) -> str:
        return self.name.rsplit("_", 1)[1]


@dataclass(frozen=True)
class RolloutCorrection:
    """The correction for a rollout engine's log-probs l_r (the loss's ``rollout_logprobs``)
    against the behaviour policy's l_o (``old_logprobs``): a detached weight
    w = exp(l_o - l_r) per token, or per response (``level``; the log ratio clamped to
    +-LOG_RATIO_CLAMP), shaped by ``rule`` (:data:`CORRECTION_RULES`) within
    [lower, upper] (None: unbounded on that side), optionally divided by its mean over the
    batch (``batch_normalize``: over the counted tokens, or the responses at sequence
    level; over every rank when torch.distributed is initialised, a collective); and
    ``rejection`` filters (:class:`RejectionFilter`, or a dict {name: upper or
    (lower, upper)}) that AND together. ``level=None`` forms no weight (filters only).
    The defaults are TRL's with vLLM: a sequence mask above 3."""

    level: str | None = "sequence"
    rule: str = "mask"
    lower: float | None = None
    upper: float | None = 3.0
    batch_normalize: bool = False
    rejection: tuple[RejectionFilter, ...] = ()

    def __post_init__(self) -> None:
        if self.level is not None and self.level not in CORRECTION_LEVELS:
            raise ValueError(f"unknown rollout correction level {self.level!r}; expected one of "
                             f"{CORRECTION_LEVELS} or None")
        if self.rule not in CORRECTION_RULES:
            raise ValueError(f"unknown rollout correction rule {self.rule!r}; expected one of {CORRECTION_RULES}")
        for name in ("lower", "upper"):
            if getattr(self, name) is not None:
                check_finite_positive(f"rollout correction {name} bound", getattr(self, name))
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"rollout correction bounds out of order: lower {self.lower} > upper {self.upper}")
        if not isinstance(self.batch_normalize, bool):
            raise TypeError(f"batch_normalize must be a bool, got {self.batch_normalize!r}")
        if self.batch_normalize and self.level is None:
            raise ValueError("batch_normalize normalises the rollout weights: it needs a level")
        items = tuple(self.rejection.items()) if isinstance(self.rejection, dict) else tuple(self.rejection)
        parsed = []
        for item in items:
            if isinstance(item, RejectionFilter):
                parsed.append(item)
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                name, bounds = item
                lower, upper = bounds if isinstance(bounds, tuple) else (None, bounds)
                parsed.append(RejectionFilter(name, upper=upper, lower=lower))
            else:
                raise TypeError("rejection takes RejectionFilter items or a dict {name: upper or (lower, upper)}, "
                                f"got {item!r}")
        names = [item.name for item in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"rejection names a filter twice: {names}")
        object.__setattr__(self, "rejection", tuple(parsed))

    @classmethod
    def from_trl(cls, mode: str, clip_min: float | None, clip_max: float | None) -> "RolloutCorrection":
        """TRL's ``vllm_importance_sampling_mode`` ("token_truncate", "token_mask",
        "sequence_truncate", "sequence_mask") with its clip_min and clip_max."""
        if not isinstance(mode, str):
            raise TypeError(f"vllm_importance_sampling_mode must be one of TRL's modes ('token_truncate', "
                            f"'token_mask', 'sequence_truncate', 'sequence_mask'), got {mode!r}")
        level, _, rule = mode.partition("_")
        if level not in CORRECTION_LEVELS or rule not in CORRECTION_RULES:
            raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")
        return cls(level=level, rule=rule, lower=clip_min, upper=clip_max)

    @classmethod
    def from_verl(cls, rollout_is: str | None = None, rollout_is_threshold: str | float | None = 2.0,
                  rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                  rollout_rs_threshold: str | float | None = None) -> "RolloutCorrection":
        """verl's ``algorithm.rollout_correction`` options: ``rollout_is`` "token" or
        "sequence" with a threshold "upper" (TIS) or "lower_upper" (IcePop), and the
        comma-separated ``rollout_rs`` filters with one threshold each (or one for all;
        a k1 threshold is "lower_upper" or "upper")."""
        lower, upper = (_verl_bounds(rollout_is_threshold, "rollout_is_threshold") if rollout_is is not None
                        else (None, None))
        filters = []
        if rollout_rs is not None:
            names = [name.strip() for name in rollout_rs.split(",") if name.strip()]
            if rollout_rs_threshold is None:
                raise ValueError("rollout_rs needs rollout_rs_threshold")
            specs = [part.strip() for part in str(rollout_rs_threshold).split(",") if part.strip()]
            specs = specs * len(names) if len(specs) == 1 else specs
            if len(specs) != len(names):
                raise ValueError(f"rollout_rs_threshold has {len(specs)} values for {len(names)} filters")
            for name, spec in zip(names, specs):
                filter_lower, filter_upper = _verl_bounds(spec, "rollout_rs_threshold")
                filters.append(RejectionFilter(name, upper=filter_upper, lower=filter_lower))
        return cls(level=rollout_is, rule="truncate" if lower is None else "mask", lower=lower, upper=upper,
                   batch_normalize=rollout_is_batch_normalize, rejection=tuple(filters))


# A number as verl's thresholds write one: digits, a point, an exponent; no Python
# digit-group underscores, which would read "0.5_2_0" (a malformed "lower_upper") as 20.
_VERL_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _verl_bounds(spec, option: str) -> tuple[float | None, float]:
    """verl's threshold "upper" or "lower_upper" (or a number: the upper bound)."""
    expected = "a number, or a string 'upper' or 'lower_upper' such as '2.0' or '0.5_2.0'"
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError(f"{option} must be {expected}, got {spec!r}")
    if not isinstance(spec, str):
        return None, float(spec)
    parts = spec.strip().split("_")
    if len(parts) > 2 or not all(_VERL_NUMBER.fullmatch(part) for part in parts):
        raise ValueError(f"{option} must be {expected}, got {spec!r}")
    bounds = [float(part) for part in parts]
    return (None, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])


@dataclass(frozen=True)
class LossPreset:
    """What a loss type means: the objective and its ratio form, the aggregation, the std
    normalisation and the clip range (docs/math.md, section 5b), and the objective's
    options where the host sets them otherwise than the objective's defaults."""

    normalize_std: bool
    loss_agg_mode: str
    clip_range: tuple[float, float]
    objective: str = "clip"
    ratio_level: str = "token"
    options: dict = field(default_factory=dict)

    @property
    def sequence_level(self) -> bool:
        return self.ratio_level != "token"


# TRL's loss types under their names (TRL 1.16's defaults), GSPO with the seed's ranges,
# and verl's policy losses that TRL lacks (verl's sapo and gspo are TRL's; verl's cispo is
# cispo_clip: see docs/options.md for the host names).
LOSS_PRESETS = {
    "grpo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(0.2, 0.2)),
    # TRL's bnpo: token-mean over the call (dapo's count is the whole batch's: a normaliser).
    "bnpo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2)),
    # DAPO's decoupled clip (docs/math.md, section 5).
    "dapo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.28)),
    # GSPO's sequence-level ranges from the seed's Table 8.
    "gspo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(3e-4, 4e-4),
                       ratio_level="gspo_token"),
    "dr_grpo": LossPreset(normalize_std=False, loss_agg_mode="seq-mean-token-sum-norm", clip_range=(0.2, 0.2)),
    "cispo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="cispo_cap"),
    "sapo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(0.2, 0.2),
                       objective="sapo"),
    # LUSPO: GSPO's sequence ratio, each response's loss weighed by its length.
    "luspo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-sum", clip_range=(0.2, 0.2),
                        ratio_level="sequence"),
    "vespo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="vespo",
                        ratio_level="sequence"),
    # GMPO: TRL's experimental default log-space range.
    "gmpo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(0.4, 0.4),
                       objective="gmpo", ratio_level="sequence"),
    "gpg": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="gpg"),
    # verl's other policy losses, with the ranges verl's actor defaults to; dro's beta has no
    # default (verl requires one), its preset takes 0.1.
    "dppo_tv": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="dppo_tv"),
    "dppo_kl": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="dppo_kl"),
    "dro": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="dro",
                      options={"dro_beta": 0.1}),
    "clip_cov": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2),
                           objective="clip_cov"),
    "kl_cov": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="kl_cov"),
}
LOSS_TYPES = tuple(LOSS_PRESETS)


def _compiling() -> bool:
    import torch  # (config.py is read by setup.py without torch)

    return torch.compiler.is_compiling()


def cached_unless_compiling(cached, key, direct):
    """``cached(key())``, a call's value formed once per key, or ``direct()`` under
    torch.compile (traced once per graph; Dynamo does not trace the cache) or for a key
    that does not hash (an option of the wrong type, a list say, which ``direct`` then
    refuses by name)."""
    if _compiling():
        return direct()
    key = key()
    try:
        hash(key)
    except TypeError:
        return direct()
    return cached(key)


# SAPO's temperatures for which every backend's float32 arithmetic stays finite.
SAPO_TEMPERATURE_RANGE = (1e-30, 1e30)


def check_finite_positive(name: str, value) -> None:
    """``value`` is a finite positive real (lambda_scale, std_eps, ...): strings, bools,
    NaN and non-positive values raise ValueError naming ``name``. Under torch.compile a
    float argument is symbolic and its value is not checked (docs/architecture.md,
    "torch.compile")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    if not _compiling() and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")


def check_block_rows(block_rows, name: str = "block_rows") -> None:
    """None (the backend's default) or a positive int."""
    if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1):
        raise ValueError(f"{name} must be a positive int, got {block_rows!r}")


def check_linear_path(linear_path, name: str = "linear_path") -> None:
    if linear_path not in LINEAR_PATHS:
        raise ValueError(f"unknown {name} {linear_path!r}; expected one of {LINEAR_PATHS}")


# How LossConfig's annotations read in its messages; a bool is not a number here, and an
# int is a float (as a float annotation means in Python).
_TYPE_NAMES = {int: "an int", float: "a number", bool: "a bool", str: "a string", types.NoneType: "None",
               RolloutCorrection: "a RolloutCorrection"}


def _has_type(value, kind: type) -> bool:
    if kind is types.NoneType or kind is bool or kind is str or kind is RolloutCorrection:
        return isinstance(value, kind)
    numeric = (int, float) if kind is float else (kind,)
    return isinstance(value, numeric) and not isinstance(value, bool)


@dataclass(frozen=True)
class LossConfig:
    """Everything about the loss that is not a tensor, resolved from a preset.

    ``group_size`` is None when the caller passes advantages instead of rewards.
    ``loss_normalizer`` replaces the call's own count in the aggregation (see
    :data:`AGG_MODES`) so that micro-batches of one rollout batch add up to the
    big-batch loss. ``max_response_length`` is the constant L of
    ``seq-mean-token-sum-norm`` (default: the mask width).
    """

    group_size: int | None
    normalize_std: bool
    loss_agg_mode: str
    epsilon_low: float
    epsilon_high: float
    objective: str = "clip"
    ratio_level: str = "token"
    std_eps: float = DEFAULT_STD_EPS
    lambda_scale: float = DEFAULT_LAMBDA_SCALE
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_normalizer: float | None = None
    max_response_length: int | None = None
    # The objectives' own options (OBJECTIVES[...].options; None: the objective's default).
    dual_clip: float | None = None
    delta: float | None = None
    ratio_cap: float | None = None
    sapo_temperature_pos: float | None = None
    sapo_temperature_neg: float | None = None
    vespo_k_pos: float | None = None
    vespo_lambda_pos: float | None = None
    vespo_k_neg: float | None = None
    vespo_lambda_neg: float | None = None
    dro_beta: float | None = None
    clip_cov_ratio: float | None = None
    clip_cov_lb: float | None = None
    clip_cov_ub: float | None = None
    kl_cov_ratio: float | None = None
    ppo_kl_coef: float | None = None
    # Rollout correction and token masks (docs/math.md, section 5d; correction.py).
    rollout_correction: RolloutCorrection | None = None
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_mask_dtype: str = "entropy"
    kl_bias_correction: bool = False
    kl_bias_ratio: str = "objective"

    @property
    def sequence_level(self) -> bool:
        """Whether a token's ratio depends on its whole response (GSPO's forms, GMPO,
        VESPO): such a loss has no gradients-in-forward linear path."""
        return self.ratio_level != "token"

    def option(self, name: str) -> float | None:
        """An objective option's value: as set, else the objective's default."""
        value = getattr(self, name)
        return OBJECTIVES[self.objective].options.get(name) if value is None else value

    @classmethod
    def build(
        cls,
        loss_type: str,
        group_size: int | None = None,
        *,
        normalize_std: bool | None = None,
        loss_agg_mode: str | None = None,
        epsilon_low: float | None = None,
        epsilon_high: float | None = None,
        objective: str | None = None,
        ratio_level: str | None = None,
        **options,
    ) -> "LossConfig":
        """The preset of ``loss_type`` with every option given (not None) overriding it.
        A preset's objective options apply when the preset's objective does."""
        unknown = sorted(set(options) - set(_FIELD_TYPES))
        if unknown:
            raise TypeError(f"unknown options {unknown}; LossConfig's options are {sorted(_FIELD_TYPES)}")
        if loss_type not in LOSS_PRESETS:
            raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
        preset = LOSS_PRESETS[loss_type]
        chosen = preset.objective if objective is None else objective
        if ratio_level is None:
            allowed = OBJECTIVES[chosen].ratio_levels if chosen in OBJECTIVES else RATIO_LEVELS
            ratio_level = preset.ratio_level if preset.ratio_level in allowed else allowed[0]
        preset_options = preset.options if chosen == preset.objective else {}
        config = cls(
            group_size=group_size,
            normalize_std=preset.normalize_std if normalize_std is None else normalize_std,
            loss_agg_mode=preset.loss_agg_mode if loss_agg_mode is None else loss_agg_mode,
            epsilon_low=preset.clip_range[0] if epsilon_low is None else epsilon_low,
            epsilon_high=preset.clip_range[1] if epsilon_high is None else epsilon_high,
            objective=chosen,
            ratio_level=ratio_level,
            **{**preset_options, **{key: value for key, value in options.items() if value is not None}},
        )
        config.validate()
        return config

    def validate(self) -> None:
        # Every field's type first, from the annotations: the range checks below compare.
        for name, accepted in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not any(_has_type(value, kind) for kind in accepted):
                expected = " or ".join(_TYPE_NAMES[kind] for kind in accepted)
                raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
        if self.group_size is not None and self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (a group-relative baseline), got {self.group_size}")
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; expected one of {AGG_MODES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; expected one of {KL_ESTIMATORS}")
        # epsilon_low >= 1 is taken, as verl takes it: a ratio's lower bound 1 - eps at or
        # below 0 clips nothing (verl's CISPO runs use 10), and GMPO's log-ratio bound and
        # DPPO's divergence thresholds read it as they are.
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise ValueError(f"{name} (clip range) must be a finite non-negative number, got {value!r}")
        check_finite_positive("std_eps", self.std_eps)
        check_finite_positive("lambda_scale", self.lambda_scale)
        if not (0 <= self.beta < math.inf):
            raise ValueError(f"beta (KL coefficient) must be finite and non-negative, got {self.beta!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; expected one of {OBJECTIVE_NAMES}")
        if self.ratio_level not in OBJECTIVES[self.objective].ratio_levels:
            raise ValueError(f"objective {self.objective!r} takes ratio_level in {OBJECTIVES[self.objective].ratio_levels}"
                             f", got {self.ratio_level!r}")
        for name, owners in OBJECTIVE_OPTIONS.items():
            if self.objective not in owners and getattr(self, name) is not None:
                readers = " or ".join(repr(owner) for owner in owners)
                raise ValueError(f"{name} is an option of the {readers} objective, not of {self.objective!r}")
        if self.dual_clip is not None and not (1 < self.dual_clip < math.inf):
            raise ValueError(f"dual_clip must be finite and greater than 1, got {self.dual_clip!r}")
        if self.delta is not None:
            # At or above 1 + epsilon_high, delta bounds the negative advantages' loss as
            # dual_clip=delta does; below it, it also caps the positive ones (TRL allows both).
            check_finite_positive("delta", self.delta)
        if "ratio_cap" in OBJECTIVES[self.objective].options and not (1 <= self.option("ratio_cap") < math.inf):
            # TRL's epsilon_high left at its 0.2 would cap every weight far below 1 (docs/options.md).
            raise ValueError(f"ratio_cap (the absolute cap on the detached ratio) must be finite and at least 1 "
                             f"(TRL recommends 5), got {self.option('ratio_cap')!r}")
        if self.objective == "dro" and self.option("dro_beta") is None:
            raise ValueError("objective 'dro' needs dro_beta (its quadratic log-ratio penalty; verl has no default)")
        for name in ("dro_beta", "clip_cov_ratio", "kl_cov_ratio"):
            if getattr(self, name) is not None:
                check_finite_positive(name, getattr(self, name))
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if getattr(self, name) is not None and getattr(self, name) > 1:
                raise ValueError(f"{name} (the share of tokens selected) must be in (0, 1], got {getattr(self, name)!r}")
        if self.objective == "clip_cov" and not (-math.inf < self.option("clip_cov_lb") < self.option("clip_cov_ub")
                                                 < math.inf):
            raise ValueError(f"clip_cov_lb < clip_cov_ub, both finite (the covariance band of the candidates), got "
                             f"{self.option('clip_cov_lb')!r} and {self.option('clip_cov_ub')!r}")
        if self.ppo_kl_coef is not None and not (0 <= self.ppo_kl_coef < math.inf):
            raise ValueError(f"ppo_kl_coef must be finite and non-negative, got {self.ppo_kl_coef!r}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            if getattr(self, name) is not None:
                check_finite_positive(name, getattr(self, name))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            value = getattr(self, name)
            if value is not None and not _compiling() and not SAPO_TEMPERATURE_RANGE[0] <= value <= SAPO_TEMPERATURE_RANGE[1]:
                # The kernels compute in fp32: 4 / tau overflows below the range, tau itself
                # above it, and tau (rho - 1) is then NaN on policy (inf * 0).
                raise ValueError(f"{name} must lie in [{SAPO_TEMPERATURE_RANGE[0]:g}, {SAPO_TEMPERATURE_RANGE[1]:g}] "
                                 f"(the gate's scale 4 / tau and its slope stay finite in float32), got {value!r}")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            value = getattr(self, name)
            if value is not None and not (0 <= value < math.inf):
                raise ValueError(f"{name} must be finite and non-negative, got {value!r}")
        if not (0 <= self.entropy_coef < math.inf):
            raise ValueError(f"entropy_coef must be finite and non-negative, got {self.entropy_coef!r}")
        if self.loss_normalizer is not None:
            check_finite_positive("loss_normalizer", self.loss_normalizer)
        if self.off_policy_mask_threshold is not None and not (0 <= self.off_policy_mask_threshold < math.inf):
            raise ValueError(f"off_policy_mask_threshold (a mean KL per token) must be finite and non-negative, "
                             f"got {self.off_policy_mask_threshold!r}")
        if not (0 < self.top_entropy_quantile <= 1):
            raise ValueError(f"top_entropy_quantile (the share of tokens kept, by entropy) must be in (0, 1], "
                             f"got {self.top_entropy_quantile!r}")
        if self.entropy_mask_dtype not in ENTROPY_MASK_DTYPES:
            raise ValueError(f"entropy_mask_dtype must be one of {ENTROPY_MASK_DTYPES}, got "
                             f"{self.entropy_mask_dtype!r}")
        if self.kl_bias_correction and self.beta == 0:
            raise ValueError("kl_bias_correction weighs the KL term by the ratio: it needs beta > 0")
        if self.kl_bias_ratio not in KL_BIAS_RATIOS:
            raise ValueError(f"kl_bias_ratio must be one of {KL_BIAS_RATIOS}, got {self.kl_bias_ratio!r}")
        if self.kl_bias_ratio != "objective" and not self.kl_bias_correction:
            raise ValueError(f"kl_bias_ratio={self.kl_bias_ratio!r} chooses the ratio of the bias-corrected KL: "
                             "it needs kl_bias_correction=True")
        if self.max_response_length is not None and self.max_response_length < 1:
            raise ValueError(f"max_response_length must be positive, got {self.max_response_length}")
        if (
            self.loss_agg_mode == "seq-mean-token-sum-norm"
            and self.loss_normalizer is not None
            and self.max_response_length is None
        ):
            # Micro-batches padded to their own widths would each divide by their own
            # width and no longer add up to the big batch.
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' with a loss_normalizer (gradient accumulation) "
                "needs max_response_length: the constant length every micro-batch divides by"
            )

    def validated(self) -> None:
        """:meth:`validate`, run once per config (a config is frozen; a failing one is
        checked again next time): a call given ``config=`` asks on every call."""
        self._checked  # (its first read validates; a failure is not kept, and raises again)

    @functools.cached_property
    def _checked(self) -> bool:
        self.validate()
        return True

    def kernel_options(self) -> dict:
        """The resolved options as the ops take them (``ops.schemas``): names of modes
        become their index in :data:`AGG_MODES`, :data:`RATIO_LEVELS`, :data:`KL_ESTIMATORS`.
        Formed once per config (a config is frozen), but under torch.compile; each call
        gets its own dict, so a caller that edits one changes no other call's."""
        if _compiling():
            return self._kernel_options()
        return dict(self._formed_kernel_options)

    @functools.cached_property
    def _formed_kernel_options(self) -> dict:
        # Kept on the instance, not in a cache keyed by the config: hashing a config's
        # fields cost as much as forming the dict.
        return self._kernel_options()

    def _kernel_options(self) -> dict:
        return dict(
            group_size=self.group_size,
            normalize_std=self.normalize_std,
            std_eps=float(self.std_eps),
            lambda_scale=float(self.lambda_scale),
            loss_agg_mode=AGG_MODES.index(self.loss_agg_mode),
            ratio_level=RATIO_LEVELS.index(self.ratio_level),
            **self.token_options(),
            loss_normalizer=None if self.loss_normalizer is None else float(self.loss_normalizer),
            max_response_length=self.max_response_length,
        )

    def objective_options(self) -> list[float]:
        """The objective's option vector, as the ops take it: its options' values in the
        order of its row of :data:`OBJECTIVES`, an option that is off (None) as +inf."""
        return [math.inf if value is None else float(value)
                for value in (self.option(name) for name in OBJECTIVES[self.objective].options)]

    def token_options(self) -> dict:
        """The options of the per-token objective, as the ops take them: the objective as
        its index in :data:`OBJECTIVE_NAMES` and its option vector."""
        return dict(
            objective=OBJECTIVE_NAMES.index(self.objective),
            epsilon_low=float(self.epsilon_low),
            epsilon_high=float(self.epsilon_high),
            objective_options=self.objective_options(),
            beta=float(self.beta),
            kl_estimator=KL_ESTIMATORS.index(self.kl_estimator),
            entropy_coef=float(self.entropy_coef),
        )


# Each LossConfig field's accepted types, from its annotation (NoneType where None is),
# read once: validate() runs on every call, under torch.compile too.
_FIELD_TYPES = {name: typing.get_args(hint) or (hint,) for name, hint in typing.get_type_hints(LossConfig).items()}


class LossOptions(TypedDict, total=False):
    """The loss's options as keywords of the two losses (their ``**options``):
    ``loss_type`` (default "grpo") and the fields of :class:`LossConfig`. Left out or
    None: the preset's value, or LossConfig's default; ``entropy_coef`` is the linear
    loss's only."""

    loss_type: str | None
    group_size: int | None
    normalize_std: bool | None
    loss_agg_mode: str | None
    epsilon_low: float | None
    epsilon_high: float | None
    objective: str | None
    ratio_level: str | None
    std_eps: float | None
    lambda_scale: float | None
    beta: float | None
    kl_estimator: str | None
    entropy_coef: float | None
    loss_normalizer: float | None
    max_response_length: int | None
    dual_clip: float | None
    delta: float | None
    ratio_cap: float | None
    sapo_temperature_pos: float | None
    sapo_temperature_neg: float | None
    vespo_k_pos: float | None
    vespo_lambda_pos: float | None
    vespo_k_neg: float | None
    vespo_lambda_neg: float | None
    dro_beta: float | None
    clip_cov_ratio: float | None
    clip_cov_lb: float | None
    clip_cov_ub: float | None
    kl_cov_ratio: float | None
    ppo_kl_coef: float | None
    rollout_correction: RolloutCorrection | None
    off_policy_mask_threshold: float | None
    top_entropy_quantile: float | None
    entropy_mask_dtype: str | None
    kl_bias_correction: bool | None
    kl_bias_ratio: str | None
