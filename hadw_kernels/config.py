"""The hyperparameters of one loss call, checked once, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

LOSS_TYPES = ("grpo", "dapo", "gspo", "dr_grpo")

# (epsilon_low, epsilon_high) by loss type: SPEC section 5 (DAPO's decoupled clip,
# GSPO's sequence-level ranges from the seed's Table 8).
DEFAULT_CLIP_RANGE = {
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "dr_grpo": (0.2, 0.2),
}

DEFAULT_LAMBDA_SCALE = 1.3  # the paper's best value (Table 7)

# rho = exp(clamp(log-ratio)): keeps exp finite for any policy drift.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossConfig:
    """Everything about the loss that is not a tensor.

    ``loss_normalizer`` replaces the batch denominator (valid tokens for dapo, responses
    for the others) so that micro-batches of one rollout batch add up to the big-batch
    loss. ``max_response_length`` is Dr.GRPO's constant L_max (default: the mask width).
    """

    loss_type: str
    group_size: int
    epsilon_low: float
    epsilon_high: float
    lambda_scale: float = DEFAULT_LAMBDA_SCALE
    beta: float = 0.0
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    loss_normalizer: float | None = None
    max_response_length: int | None = None

    @property
    def normalize_std(self) -> bool:
        return self.loss_type != "dr_grpo"

    @property
    def sequence_level(self) -> bool:
        return self.loss_type == "gspo"

    @classmethod
    def build(
        cls,
        loss_type: str,
        group_size: int,
        epsilon_low: float | None = None,
        epsilon_high: float | None = None,
        **options,
    ) -> "LossConfig":
        """Fills the clip range from the loss type and validates every field."""
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
        default_low, default_high = DEFAULT_CLIP_RANGE[loss_type]
        config = cls(
            loss_type=loss_type,
            group_size=group_size,
            epsilon_low=default_low if epsilon_low is None else float(epsilon_low),
            epsilon_high=default_high if epsilon_high is None else float(epsilon_high),
            **options,
        )
        config.validate()
        return config

    def validate(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise TypeError(f"group_size must be an int, got {type(self.group_size).__name__}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (a group-relative baseline), got {self.group_size}")
        if not (self.epsilon_low >= 0 and self.epsilon_high >= 0):
            raise ValueError(
                f"clip ranges must be non-negative, got epsilon_low={self.epsilon_low}, "
                f"epsilon_high={self.epsilon_high}"
            )
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low must be below 1 (the ratio is positive), got {self.epsilon_low}")
        if not self.lambda_scale > 0:
            raise ValueError(f"lambda_scale must be positive, got {self.lambda_scale}")
        if not self.beta >= 0:
            raise ValueError(f"beta (KL coefficient) must be non-negative, got {self.beta}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be greater than 1, got {self.dual_clip}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"entropy_coef must be non-negative, got {self.entropy_coef}")
        if self.loss_normalizer is not None and not self.loss_normalizer > 0:
            raise ValueError(f"loss_normalizer must be positive, got {self.loss_normalizer}")
        if self.max_response_length is not None and not self.max_response_length > 0:
            raise ValueError(f"max_response_length must be positive, got {self.max_response_length}")
