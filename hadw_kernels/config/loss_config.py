"""What a loss is: :class:`LossConfig`, the resolved options every implementation
receives, built from a loss type's preset (``presets.py``) with any option overriding it,
and :data:`LossOptions`, the same options as the losses' keywords.

A loss type (``grpo``, ``dapo``, ``gspo``, ``dr_grpo``, ...) is a preset of choices; the
reference (``reference/surrogate.py``), the Triton kernels and the C++ kernels receive the
resolved values, never the loss type's name. The choices are rows of tables by concept:
the objectives and their options (``objectives/table.py``; ``LossConfig`` has a field per
option and checks it by its row), the aggregation modes (``tables/aggregations.py``), the
rollout correction (``tables/corrections.py``), the metrics (``metrics.py``). The C++ build
generates its constants from those modules and this one (``backends/cpp_constants.py``).
"""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import dataclass

from ..objectives.table import OBJECTIVE_NAMES, OBJECTIVE_OPTIONS, OBJECTIVES, RATIO_LEVELS
from ..tables.aggregations import AGG_MODES
from ..tables.bounds import NON_NEGATIVE, POSITIVE, Bounds, compiling
from ..tables.corrections import RolloutCorrection
from ..tables.estimators import ESTIMATOR_NAMES, ESTIMATORS, check_std_choice, estimator_row
from .presets import LOSS_PRESETS, LOSS_TYPES

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

DEFAULT_STD_EPS = 1e-6
DEFAULT_LAMBDA_SCALE = 1.3  # the paper's best value (Table 7)
AUTHORS_LAMBDA_SCALE = 1.5  # the authors' public code


# The ranges of LossConfig's fields (an objective option's are its row's). epsilon_low
# >= 1 is taken, as verl takes it: a ratio's lower bound 1 - eps at or below 0 clips
# nothing (verl's CISPO runs use 10), and GMPO's log-ratio bound and DPPO's divergence
# thresholds read it as they are.
_CLIP_RANGE = Bounds(0.0, math.inf, "be a finite non-negative number", low_closed=True, gloss="clip range")
FIELD_BOUNDS = {
    "group_size": Bounds(2, math.inf, "be at least 2 (a group-relative baseline)", low_closed=True),
    "epsilon_low": _CLIP_RANGE,
    "epsilon_high": _CLIP_RANGE,
    "std_eps": POSITIVE,
    "lambda_scale": POSITIVE,
    "beta": Bounds(0.0, math.inf, "be finite and non-negative", low_closed=True, gloss="KL coefficient"),
    "entropy_coef": NON_NEGATIVE,
    "loss_normalizer": POSITIVE,
    "max_response_length": Bounds(1, math.inf, "be positive", low_closed=True),
    "off_policy_mask_threshold": Bounds(0.0, math.inf, "be finite and non-negative", low_closed=True,
                                        gloss="a mean KL per token"),
    "top_entropy_quantile": Bounds(0.0, 1.0, "be in (0, 1]", high_closed=True,
                                   gloss="the share of tokens kept, by entropy"),
}

# How LossConfig's annotations read in its messages; a bool is not a number here, and an
# int is a float (as a float annotation means in Python).
_TYPE_NAMES = {int: "an int", float: "a number", bool: "a bool", str: "a string", types.NoneType: "None",
               RolloutCorrection: "a RolloutCorrection"}


def _has_type(value, kind: type) -> bool:
    if kind is types.NoneType or kind is bool or kind is str or kind is RolloutCorrection:
        return isinstance(value, kind)
    numeric = (int, float) if kind is float else (kind,)
    return isinstance(value, numeric) and not isinstance(value, bool)


def _takes_std(estimator) -> bool:
    """Whether an estimator named in the options lets the preset's std divide its
    advantage; an unknown name is left to validate()'s message."""
    return estimator is None or estimator not in ESTIMATORS or ESTIMATORS[estimator].takes_std


@dataclass(frozen=True)
class LossConfig:
    """Everything about the loss that is not a tensor, resolved from a preset.

    ``group_size`` is None when the caller passes advantages instead of rewards.
    ``loss_normalizer`` replaces the call's own count in the aggregation (see
    :data:`AGG_MODES`) so that micro-batches of one rollout batch add up to the
    big-batch loss. ``max_response_length`` is the constant L of
    ``seq-mean-token-sum-norm`` (default: the mask width). After it, a field per
    objective option (``objectives.table.OBJECTIVES``; None: the objective's default).
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
    # The baseline of the advantage formed from rewards (estimators.ESTIMATORS; docs/math.md,
    # section 2a). The history estimators need state across calls: their advantages are
    # formed by hadw_advantages and passed as advantages.
    advantage_estimator: str = "grpo"
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_normalizer: float | None = None
    max_response_length: int | None = None
    # Generated by `python -m hadw_kernels.tools.codegen` from objectives.table.OBJECTIVES: do not edit.
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
    # End of the generated option fields.
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
        if value is not None:
            return value
        row = OBJECTIVES[self.objective].options.get(name)
        return None if row is None else row.default

    def reward_group_size(self) -> int:
        """``group_size``, which a call with rewards (or a group index) has: validation
        refuses rewards without it (``check_batch_inputs``), so what forms advantages
        from rewards reads it here. Raises that same error where it is None."""
        if self.group_size is None:
            raise ValueError("rewards need group_size (responses per prompt, each group's rows contiguous)")
        return self.group_size

    def option_value(self, name: str) -> float:
        """An objective option a formula reads as a number: :meth:`option`'s value, which
        every option the formulas read this way has (a default, or ``required`` and so
        refused by :meth:`validate` when unset). Raises ValueError naming the option where
        it has none: a call on a config its objective does not read it from, or a row
        changed without its formula."""
        value = self.option(name)
        if value is None:
            raise ValueError(f"objective {self.objective!r} has no value for option {name!r}")
        return value

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
            # The preset's std applies to the group mean's advantage alone (estimators.py).
            normalize_std=(preset.normalize_std and _takes_std(options.get("advantage_estimator"))
                           if normalize_std is None else normalize_std),
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
        # Then each field's range, by its bounds (None: off, not checked); under
        # torch.compile a number may be symbolic, and no value is checked.
        if not compiling():
            for name, bounds in FIELD_BOUNDS.items():
                value = getattr(self, name)
                if value is not None:
                    bounds.check(name, value)
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; expected one of {AGG_MODES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; expected one of {KL_ESTIMATORS}")
        estimator = estimator_row(self.advantage_estimator)
        check_std_choice(estimator, self.normalize_std)
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; expected one of {OBJECTIVE_NAMES}")
        if self.ratio_level not in OBJECTIVES[self.objective].ratio_levels:
            raise ValueError(f"objective {self.objective!r} takes ratio_level in {OBJECTIVES[self.objective].ratio_levels}"
                             f", got {self.ratio_level!r}")
        for name, owners in OBJECTIVE_OPTIONS.items():
            if self.objective not in owners and getattr(self, name) is not None:
                readers = " or ".join(repr(owner) for owner in owners)
                raise ValueError(f"{name} is an option of the {readers} objective, not of {self.objective!r}")
        objective = OBJECTIVES[self.objective]
        for option in objective.options.values():
            value = getattr(self, option.name)
            if value is not None:
                option.check(value)
            elif option.required:
                raise ValueError(f"objective {self.objective!r} needs {option.name} ({option.doc})")
        for lower, upper in objective.increasing:
            if compiling():
                continue
            low, high = self.option(lower), self.option(upper)
            if low is None or high is None:
                # Only a table row whose pair has no default and is not required gets here.
                raise ValueError(f"{lower} and {upper} must both be set to be compared, got {low!r} and {high!r}")
            if not low < high:
                raise ValueError(f"{lower} must be below {upper}, got {low!r} and {high!r}")
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
        _ = self._checked  # (its first read validates; a failure is not kept, and raises again)

    @functools.cached_property
    def _checked(self) -> bool:
        self.validate()
        return True

    def kernel_options(self) -> dict:
        """The resolved options as the ops take them (``ops.schemas``): names of modes
        become their index in :data:`AGG_MODES`, :data:`RATIO_LEVELS`, :data:`KL_ESTIMATORS`,
        ``tables.estimators.ESTIMATOR_NAMES``.
        Formed once per config (a config is frozen), but under torch.compile; each call
        gets its own dict, so a caller that edits one changes no other call's."""
        if compiling():
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
            advantage_estimator=ESTIMATOR_NAMES.index(self.advantage_estimator),
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
_FIELD_HINTS = typing.get_type_hints(LossConfig)
_FIELD_TYPES = {name: typing.get_args(hint) or (hint,) for name, hint in _FIELD_HINTS.items()}
