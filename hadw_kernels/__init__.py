"""Fused GRPO-family losses with History-Aware Adaptive Difficulty Weighting (HA-DW)."""

from .advantage import group_advantages, hadw_weights
from .anchor import DifficultyAnchor
from .backends import available_backends
from .config import DEFAULT_CLIP_RANGE, LOSS_TYPES
from .loss import fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss, token_logprobs

__all__ = [
    "DEFAULT_CLIP_RANGE",
    "LOSS_TYPES",
    "DifficultyAnchor",
    "available_backends",
    "fused_hadw_grpo_loss",
    "fused_linear_hadw_grpo_loss",
    "group_advantages",
    "hadw_weights",
    "token_logprobs",
]

__version__ = "0.1.0"
