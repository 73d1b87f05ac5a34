"""Fused GRPO-family losses with History-Aware Adaptive Difficulty Weighting (HA-DW)."""

from .advantage.anchor import DifficultyAnchor
from .advantage.group import all_equal_groups, batch_totals, group_advantages, hadw_advantages, hadw_weights
from .advantage.history import PromptHistory, prompt_key
from .backends import BackendUnavailable, available_backends
from .batch.token_layout import cu_seqlens_from_position_ids
from .config.loss_config import KL_ESTIMATORS, LossConfig
from .config.presets import LOSS_PRESETS, LOSS_TYPES
from .loss import fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss, token_logprobs
from .module import HADWGRPOLoss, LinearHADWGRPOLoss
from .tables.aggregations import AGG_MODES
from .tables.corrections import RejectionFilter, RolloutCorrection
from .tables.estimators import ESTIMATOR_NAMES
from .tables.metrics import METRIC_NAMES

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
    "batch_totals",
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
