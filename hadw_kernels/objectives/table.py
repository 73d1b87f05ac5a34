"""The policy objectives as rows of one table (:data:`OBJECTIVES`), each with its options:
every backend, ``LossConfig`` (its option fields and their checks), ``LossOptions`` and
the options table of docs/options.md read them from here. The formulas are
``objectives.py``'s (docs/math.md, section 5); the kernels branch on the codes generated
from this table (``kObjective<Name>``, ``kOption<Name>``, ``kResponseStep<Name>`` in the C++
header that setup.py generates; ``OBJECTIVE_<NAME>``, ``OPTION_<NAME>``,
``RESPONSE_STEP_<NAME>`` in ``triton/codes.py``, which ``python -m hadw_kernels.tools.codegen``
writes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..tables.bounds import FINITE, NON_NEGATIVE, POSITIVE, Bounds, compiling
from . import formulas as f
from .formulas import LOG_RATIO_CLAMP as LOG_RATIO_CLAMP
from .formulas import VESPO_LOG_WEIGHT_MIN as VESPO_LOG_WEIGHT_MIN

# How the importance ratio of a token is formed (docs/math.md, section 5):
#   token       rho_t = exp(l_t - lo_t)
#   sequence    rho_t = s_i = exp(mean over the response's tokens of l - lo), the gradient
#               reaching every token of the response through s_i (TRL's "sequence")
#   gspo_token  rho_t = sg[s_i] exp(l_t - sg[l_t]): s_i's value, the gradient through the
#               token's own log-prob (verl's gspo, TRL's "sequence_token")
# The two sequence forms give the same loss and gradient unless per-token importance
# weights differ within a response.
RATIO_LEVELS = ("token", "sequence", "gspo_token")

# What an objective reads of its whole response before its per-token formula (docs/math.md,
# section 5). The kernels branch on the step's code; the objective's own formula of the
# step is its row's response_formula:
#   none                    nothing (in a sequence form, s_i = exp(mean log-ratio))
#   clipped_log_ratio_mean  s_i = exp(mean of the tokens' log-ratios, each first through
#                           the objective's clip by its advantage); the sequence form's share
#                           through s_i reaches a token where its clip passes the gradient
#                           (GMPO)
#   log_ratio_sum           a stop-gradient weight per token: the objective's formula of the
#                           response's sum of log-ratios (each clamped to +-LOG_RATIO_CLAMP),
#                           one value for the tokens with A >= 0 and one for A < 0 (VESPO's
#                           phi); s_i as for none
# The token ratio form reads no whole response: an objective with a step does not take it.
RESPONSE_STEPS = ("none", "clipped_log_ratio_mean", "log_ratio_sum")

# How an objective's gradient reaches a token's log-prob (its row's slope gives it):
# "ratio": through its ratio alone (d loss / d logp = 0; in a sequence ratio form the
# slopes are summed over the response); "detached_weight": a stop-gradient weight times
# the log-prob (d loss / d rho = 0; its value's numerical derivative is not its gradient);
# "log_prob": the log-prob itself, no ratio; "ratio_and_log_prob": both (a token form).
GRADIENT_ROUTES = ("ratio", "detached_weight", "log_prob", "ratio_and_log_prob")

# The most options an objective takes: the Triton kernels receive its option vector as
# this many fp64 scalars (``option_0`` ... ``option_3`` of the kernels in
# triton/surrogate.py and triton/linear_logprob.py; Triton types a tuple's floats as fp32,
# which would round fp64 thresholds). A fifth option needs a fifth parameter there and in
# ``triton/token_math.objective_option_values``.
OPTION_SLOTS = 4


SHARE = Bounds(0.0, 1.0, "be in (0, 1] (the share of tokens selected)", high_closed=True)


@dataclass(frozen=True)
class Option:
    """An option that objectives alone read: ``name`` is its keyword (a field of
    ``LossConfig``, a keyword of ``LossConfig.build`` and of both losses), ``default``
    what None takes (None: off, no bound; the kernels read +inf), ``bounds`` what a value
    given must satisfy, ``required`` whether the objective needs a value (a None default
    then has no meaning of its own), ``doc`` one line for docs/options.md. An option
    several objectives share is declared alike in each row but for its default."""

    name: str
    default: float | None
    bounds: tuple[Bounds, ...]
    doc: str
    required: bool = False

    def check(self, value: float) -> None:
        """Refuses a value outside the bounds, naming the option; under torch.compile a
        float may be symbolic, and no value is checked (the type is, by LossConfig)."""
        if compiling():
            return
        for bounds in self.bounds:
            bounds.check(self.name, value)


@dataclass(frozen=True)
class Objective:
    """A policy objective: the per-token loss to minimise as a function of the token's
    ratio rho, its advantage A and its log-prob l (docs/math.md, section 5; the formulas
    and their derivatives are the row's ``value`` and ``slope``, written in formulas.py;
    the kernels' one branch each).

    ``options``: its :class:`Option` rows in the order of its option vector (given as a
    tuple, held by name), at most :data:`OPTION_SLOTS`. An option some objectives share
    sits at one index of each one's vector. The kernels take the resolved values as one
    vector (:meth:`LossConfig.objective_options`, an option that is off as +inf) and read
    them by the index constants generated from this table (:data:`OPTION_INDEX`).
    ``increasing``: pairs of its options (lower, upper) whose resolved values must
    increase.
    ``ratio_levels``: the ratio forms it takes (RATIO_LEVELS), the first its default.
    ``gradient``: how its gradient reaches the log-prob (GRADIENT_ROUTES); the kernels
    branch on it.
    ``value``: the per-token loss, f(rho, A, l, l_old, weight, config), what the reference
    differentiates; ``slope``: (d value / d rho, d value / d l) as autograd gives them, what
    the kernels transcribe.
    ``selection``: the batch statistic that selects tokens before the kernels run, or None
    (the kernels receive the selection per token; :attr:`selects_tokens`).
    ``response_step``: what it reads of its whole response before its per-token formula
    (:data:`RESPONSE_STEPS`), the kernels branch on it; ``response_formula`` its formula
    of that step, f(log-ratio, A, config), with a step and only then."""

    options: dict[str, Option]
    gradient: str
    value: Callable
    slope: Callable
    ratio_levels: tuple[str, ...] = RATIO_LEVELS
    selection: Callable | None = None
    increasing: tuple[tuple[str, str], ...] = ()
    response_step: str = "none"
    response_formula: Callable | None = None

    if TYPE_CHECKING:
        # The generated __init__ as it is called: ``options`` given as a tuple of rows (or
        # a dict of them), held as a dict by name once __post_init__ has checked the rows.
        # The field's annotation says what is held; this, for the checker only, what is
        # taken. Keep it in step with the fields above.
        def __init__(self, options: tuple[Option, ...] | dict[str, Option], gradient: str, value: Callable,
                     slope: Callable, ratio_levels: tuple[str, ...] = RATIO_LEVELS,
                     selection: Callable | None = None, increasing: tuple[tuple[str, str], ...] = (),
                     response_step: str = "none", response_formula: Callable | None = None) -> None: ...

    def __post_init__(self) -> None:
        rows = tuple(self.options.values()) if isinstance(self.options, dict) else tuple(self.options)
        names = [option.name for option in rows]
        if len(set(names)) != len(names):
            raise ValueError(f"an objective declares an option twice: {names}")
        if len(rows) > OPTION_SLOTS:
            raise ValueError(f"an objective takes at most {OPTION_SLOTS} options (the Triton kernels' option "
                             f"slots, objectives.table.OPTION_SLOTS), got {len(rows)}: {names}")
        if self.gradient not in GRADIENT_ROUTES:
            raise ValueError(f"an objective's gradient is one of {GRADIENT_ROUTES}, got {self.gradient!r}")
        if self.response_step not in RESPONSE_STEPS:
            raise ValueError(f"an objective's response step is one of {RESPONSE_STEPS}, got {self.response_step!r}")
        if self.response_step != "none" and "token" in self.ratio_levels:
            raise ValueError(f"an objective with response step {self.response_step!r} takes no token ratio form: "
                             "the token form reads no whole response")
        if (self.response_step == "none") != (self.response_formula is None):
            raise ValueError("an objective with a response step has its formula (response_formula), and only then")
        if self.response_step == "log_ratio_sum" and self.selects_tokens:
            raise ValueError("an objective's per-token weight is its response step's or its selection, not both")
        for option in rows:
            if option.default is not None and not all(bounds.hold(option.default) for bounds in option.bounds):
                raise ValueError(f"option {option.name!r}: its default {option.default!r} is out of its bounds")
        for pair in self.increasing:
            if not set(pair) <= set(names):
                raise ValueError(f"increasing names options the objective does not take: {pair}")
        object.__setattr__(self, "options", {option.name: option for option in rows})

    @property
    def selects_tokens(self) -> bool:
        return self.selection is not None

    @property
    def through_ratio(self) -> bool:
        return self.gradient in ("ratio", "ratio_and_log_prob")


# Declared once for the objectives that share it; each row gives its default.
_RATIO_CAP = Option("ratio_cap", None, (Bounds(1.0, math.inf, "be finite and at least 1 (TRL recommends 5)",
                                               low_closed=True),),
                    "the absolute cap on the detached ratio (TRL's CISPO: its epsilon_high; verl's DPPO: clip_ratio_c)")
_SAPO_TEMPERATURE = Bounds(1e-30, 1e30, "lie in [1e-30, 1e30] (the gate's scale 4 / tau and its slope stay finite "
                           "in float32)", low_closed=True, high_closed=True)

OBJECTIVES = {
    # PPO's clip: -min(rho' A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho' = min(rho, delta)
    # (TRL's two-sided clip), then min(., -c A) for A < 0 (dual clip, c = dual_clip).
    "clip": Objective(options=(
        Option("dual_clip", None, (Bounds(1.0, math.inf, "be finite and greater than 1"),),
               "the dual clip's bound on the loss of negative advantages, -c A"),
        # At or above 1 + epsilon_high, delta bounds the negative advantages' loss as
        # dual_clip=delta does; below it, it also caps the positive ones (TRL allows both).
        Option("delta", None, (POSITIVE,), "the cap on the unclipped ratio (TRL's two-sided clip)"),
    ), gradient="ratio", value=f.clip_value, slope=f.clip_slope),
    # CISPO as TRL defines it: -sg[min(rho, ratio_cap)] A l, an absolute cap (TRL's
    # epsilon_high; the ScaleRL paper's 5). TRL's epsilon_high left at its 0.2 would cap
    # every weight far below 1: the bound refuses it (docs/options.md).
    "cispo_cap": Objective(options=(replace(_RATIO_CAP, default=5.0),), gradient="detached_weight",
                           value=f.cispo_cap_value, slope=f.cispo_cap_slope),
    # CISPO as verl defines it: -sg[clip(rho, 1 - eps_low, 1 + eps_high)] A l.
    "cispo_clip": Objective(options=(), gradient="detached_weight", value=f.cispo_clip_value, slope=f.cispo_clip_slope),
    # SAPO: -(4 / tau) sigmoid(tau (rho - 1)) A, tau by the sign of A. The kernels compute
    # in fp32: 4 / tau overflows below the temperatures' range, tau itself above it, and
    # tau (rho - 1) is then NaN on policy (inf * 0).
    "sapo": Objective(options=(
        Option("sapo_temperature_pos", 1.0, (POSITIVE, _SAPO_TEMPERATURE), "SAPO's temperature tau for A > 0"),
        Option("sapo_temperature_neg", 1.05, (POSITIVE, _SAPO_TEMPERATURE), "SAPO's temperature tau for A <= 0"),
    ), gradient="ratio", value=f.sapo_value, slope=f.sapo_slope),
    # GMPO (verl's geo_mean): -A exp(mean over the response of l - lo clipped in log space
    # to [-eps_low, eps_high] on the side A's sign makes harmful).
    "gmpo": Objective(options=(), gradient="ratio", value=f.gmpo_value, slope=f.gmpo_slope, ratio_levels=("sequence",),
                      response_step="clipped_log_ratio_mean", response_formula=f.gmpo_log_ratio),
    # VESPO (TRL): -sg[phi] A l, phi = w^k exp(lam (1 - w)), w the response's summed ratio,
    # (k, lam) by the sign of A.
    "vespo": Objective(options=(
        Option("vespo_k_pos", 2.0, (NON_NEGATIVE,), "VESPO's gamma shape k for A >= 0"),
        Option("vespo_lambda_pos", 3.0, (POSITIVE,), "VESPO's gamma rate lambda for A >= 0"),
        Option("vespo_k_neg", 3.0, (NON_NEGATIVE,), "VESPO's gamma shape k for A < 0"),
        Option("vespo_lambda_neg", 2.0, (POSITIVE,), "VESPO's gamma rate lambda for A < 0"),
    ), gradient="detached_weight", value=f.vespo_value, slope=f.vespo_slope, ratio_levels=("sequence",),
        response_step="log_ratio_sum", response_formula=f.vespo_weight),
    # GPG (verl): -A l, no ratio.
    "gpg": Objective(options=(), gradient="log_prob", value=f.gpg_value, slope=f.gpg_slope, ratio_levels=("token",)),
    # DPPO (verl's dppo_tv, dppo_kl): -sg[min(rho, ratio_cap)] A l on the tokens whose
    # probability moved within the clip range, now a divergence bound, in the direction A's
    # sign favours (A > 0: up by at most epsilon_high; else down by at most epsilon_low):
    # p - p_old (tv), or the binary KL of (p_old, p) (kl); the other tokens give 0.
    "dppo_tv": Objective(options=(replace(_RATIO_CAP, default=20.0),), gradient="detached_weight",
                         value=f.dppo_value, slope=f.dppo_slope, ratio_levels=("token",)),
    "dppo_kl": Objective(options=(replace(_RATIO_CAP, default=20.0),), gradient="detached_weight",
                         value=f.dppo_value, slope=f.dppo_slope, ratio_levels=("token",)),
    # DRO (verl): -(A l - dro_beta / 2 (l - l_old)^2).
    "dro": Objective(options=(
        Option("dro_beta", None, (POSITIVE,), "the coefficient of its quadratic log-ratio penalty; verl has no default",
               required=True),
    ), gradient="log_prob", value=f.dro_value, slope=f.dro_slope, ratio_levels=("token",)),
    # Clip-Cov (verl): PPO's clip, 0 on max(1, floor(clip_cov_ratio N)) tokens drawn at random
    # among the unclipped ones whose (A - mean A)(l - mean l) lies in (clip_cov_lb, clip_cov_ub).
    "clip_cov": Objective(options=(
        Option("clip_cov_ratio", 2e-4, (POSITIVE, SHARE), "the share of tokens whose gradient is cut"),
        Option("clip_cov_lb", 1.0, (FINITE,), "the covariance band's lower end (exclusive)"),
        Option("clip_cov_ub", 5.0, (FINITE,), "the covariance band's upper end (exclusive)"),
    ), gradient="ratio", value=f.clip_cov_value, slope=f.clip_cov_slope, ratio_levels=("token",),
        selection=f.clip_cov_selection, increasing=(("clip_cov_lb", "clip_cov_ub"),)),
    # KL-Cov (verl): -A rho, plus ppo_kl_coef |l - l_old| on the max(1, floor(kl_cov_ratio N))
    # tokens of largest (A - mean A)(l - mean l).
    "kl_cov": Objective(options=(
        Option("kl_cov_ratio", 2e-4, (POSITIVE, SHARE), "the share of tokens that take the KL penalty"),
        Option("ppo_kl_coef", 0.1, (NON_NEGATIVE,), "the coefficient of the penalty abs(l - l_old)"),
    ), gradient="ratio_and_log_prob", value=f.kl_cov_value, slope=f.kl_cov_slope, ratio_levels=("token",),
        selection=f.kl_cov_selection),
}
OBJECTIVE_NAMES = tuple(OBJECTIVES)


def shared_options(objectives: dict[str, Objective]) -> dict[str, tuple[str, ...]]:
    """Every objective-only option of ``objectives``, with the objectives that read it.
    Raises ValueError where objectives that share an option declare it otherwise but for
    its default, or put it at other indices of their option vectors: the kernels read it
    by one index constant, and LossConfig checks it by one row. (An error, not an
    ``assert``: ``python -O`` would skip an assert.)"""
    owners_of = {option: tuple(name for name, objective in objectives.items() if option in objective.options)
                 for objective in objectives.values() for option in objective.options}
    for option, owners in owners_of.items():
        first = objectives[owners[0]]
        for owner in owners[1:]:
            row = objectives[owner]
            if replace(row.options[option], default=None) != replace(first.options[option], default=None):
                raise ValueError(f"option {option!r} is declared otherwise in {owner!r} than in {owners[0]!r}: "
                                 "a shared option is declared alike in each row but for its default")
            if list(row.options).index(option) != list(first.options).index(option):
                raise ValueError(f"option {option!r} sits at another index of {owner!r}'s option vector than of "
                                 f"{owners[0]!r}'s: a shared option has one index constant")
    return owners_of


# Every objective-only option, with the objectives that read it.
OBJECTIVE_OPTIONS = shared_options(OBJECTIVES)
# Each option's row (its first; the rows that share it differ in the default alone).
OPTIONS = {name: OBJECTIVES[owners[0]].options[name] for name, owners in OBJECTIVE_OPTIONS.items()}
# Each option's index in its objectives' option vectors (the same in every objective that
# reads it: shared_options).
OPTION_INDEX = {option: list(OBJECTIVES[owners[0]].options).index(option)
                for option, owners in OBJECTIVE_OPTIONS.items()}
