"""What a rollout correction is (docs/math.md, section 5d): its levels, rules and rejection
filters as rows, and :class:`RolloutCorrection`, a call's choice among them.
``correction.py`` computes it."""

from __future__ import annotations

from dataclasses import dataclass

from .bounds import check_finite_positive

# A rollout weight w = exp(l_old - l_rollout) is formed per token or per response (exp of the summed
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
            lower = self.lower
            if lower is None:
                lower = 1.0 / self.upper
                object.__setattr__(self, "lower", lower)
            check_finite_positive(f"rejection filter {self.name!r}'s lower bound", lower)
            if lower > self.upper:
                raise ValueError(f"rejection filter {self.name!r}: lower bound {lower} above upper {self.upper}")
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
