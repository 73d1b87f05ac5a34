"""Fused GRPO-family losses with History-Aware Adaptive Difficulty Weighting (HA-DW)."""

from .advantage import all_equal_groups, group_advantages, hadw_advantages, hadw_weights
from .anchor import DifficultyAnchor
from .estimators import ESTIMATOR_NAMES
from .history import PromptHistory, prompt_key
from .backends import BackendUnavailable, available_backends
from .aggregation_table import AGG_MODES
from .config import KL_ESTIMATORS, LossConfig
from .correction_table import RejectionFilter, RolloutCorrection
from .metrics import METRIC_NAMES
from .presets import LOSS_PRESETS, LOSS_TYPES
from .token_layout import cu_seqlens_from_position_ids
from .loss import fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss, token_logprobs
from .module import HADWGRPOLoss, LinearHADWGRPOLoss

__all__ = [
    "AGG_MODES",
    "ESTIMATOR_NAMES",
    "KL_ESTIMATORS",
    "LOSS_PRESETS",
    "LOSS_TYPES",
    "METRIC_NAMES",
    "PromptHistory",
    "BackendUnavailable",
    "DifficultyAnchor",
    "HADWGRPOLoss",
    "LinearHADWGRPOLoss",
    "LossConfig",
    "RejectionFilter",
    "RolloutCorrection",
    "all_equal_groups",
    "available_backends",
    "cu_seqlens_from_position_ids",
    "fused_hadw_grpo_loss",
    "fused_linear_hadw_grpo_loss",
    "group_advantages",
    "hadw_advantages",
    "hadw_weights",
    "prompt_key",
    "token_logprobs",
]

__version__ = "0.2.0"
