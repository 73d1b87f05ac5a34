"""HA-DW and the fused linear loss in TRL's ``GRPOTrainer`` (TRL 1.15 and 1.16, checked on
import: versions.py).

    from hadw_kernels.integrations.trl import HADWGRPOConfig, HADWGRPOTrainer

    args = HADWGRPOConfig(output_dir="out", loss_type="dapo", hadw_lambda_scale=1.3)
    trainer = HADWGRPOTrainer(model=model, reward_funcs=accuracy, args=args, train_dataset=data)
    trainer.train()

:class:`HADWGRPOTrainer` changes four things of the stock trainer and keeps the rest
(generation, rewards, reference model, logging, checkpoints):

- after TRL scores a generation batch (gathered over all processes), the batch's mean
  reward is folded into the :class:`~hadw_kernels.DifficultyAnchor` once, and TRL's
  advantages are multiplied by Phi, per response, before TRL shuffles and splits the
  rows into micro-batches;
- the loss is :func:`~hadw_kernels.fused_linear_hadw_grpo_loss` on the backbone's last
  hidden states and the LM head, given those advantages (``advantages=``: any order, any
  split), routed through the wrapped model's forward as TRL's own fused losses are; TRL's
  ``loss_type`` (each of its eight, :data:`TRL_LOSS_TYPES`), ``importance_sampling_level``,
  ``beta``, ``epsilon``/``epsilon_high`` (CISPO's cap), ``delta``, the SAPO temperatures,
  VESPO's k and lambda, ``num_items_in_batch``, gradient accumulation, the vLLM
  importance-sampling correction (``vllm_importance_sampling_*``: the loss forms the weights
  from vLLM's log-probs), ``off_policy_mask_threshold``, ``top_entropy_quantile`` and
  ``use_bias_correction_kl`` map onto its options, so with ``use_hadw=False`` the loss is
  TRL's;
- the anchor is saved in each checkpoint folder (``hadw_anchor.json``) and restored with
  the optimizer when training resumes from one, as TRL does for its entropy controller.
- the model's forwards (the training forward and those of the old and reference
  log-probs) feed it packed rows, each prompt laid out once for its completions
  (``hadw_layout``, :mod:`hadw_kernels.layouts`), wherever the segment attention serves
  the model; a generation batch is shuffled by whole groups where that changes no
  optimizer step (``hadw_shuffle``).

Options TRL has and this loss does not (the entropy bonus, MoE auxiliary loss, logit
soft-capping) are refused when the trainer is built, with the option named; CISPO with a
cap below 1 (TRL's default epsilon_high) is taken, as stock TRL takes it, with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

from .versions import require_supported

# Before trl itself is imported: an unsupported release fails here, naming the range.
require_supported("trl")

import torch
from accelerate.utils import gather_object, is_peft_model
from torch.distributed.tensor import DTensor
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import (maybe_gather_lm_head_ctx, split_pixel_values_by_grid, split_tensor_dict,
                               unsplit_pixel_values_by_grid)

from ..advantage import hadw_advantages, hadw_weights
from ..estimators import ESTIMATORS, estimator_row
from ..history import DEFAULT_DISCOUNT, DEFAULT_PRIOR_STRENGTH, PromptHistory, prompt_key
from ..anchor import (DEFAULT_ETA, DEFAULT_ETA_MIN, DEFAULT_RULE, DEFAULT_WINDOW, DifficultyAnchor,
                      batch_reward_statistics)
from ..backends import BackendUnavailable, check_backend_name, resolve_backend
from ..aggregation_table import AGGREGATIONS
from ..checks import check_finite_positive
from ..config import DEFAULT_LAMBDA_SCALE, LossConfig
from ..correction_table import RolloutCorrection
from ..linear_blocks import check_block_rows, check_linear_path
from ..objective_table import LOG_RATIO_CLAMP, OBJECTIVES, VESPO_LOG_WEIGHT_MIN
from ..presets import LOSS_PRESETS
from ..layouts import LAYOUTS, LaidOutBatch, choose_layout
from ..layouts.choice import check_layout_name
from ..layouts.rows import prompt_groups, rows_by_group
from ..loss import fused_linear_hadw_grpo_loss, refuse_gradients_in_forward, token_logprobs
from .rewards import require_unit_interval

logger = logging.getLogger(__name__)

ANCHOR_FILE = "hadw_anchor.json"
HISTORY_FILE = "hadw_history.json"


class TrlLossType(NamedTuple):
    """A TRL loss type as the fused loss computes it.

    ``preset``: the :data:`~hadw_kernels.LOSS_PRESETS` entry holding its objective and
    aggregation. ``normalizer``: the count TRL divides a micro-batch's loss by:
    "responses" (its rows), "tokens" (its valid tokens) or "items" (TRL's
    num_items_in_batch: the generation batch's tokens, every process). ``clip_metrics``:
    the clip fractions TRL logs for it: "region" (``clip_ratio/*``), "cispo"
    (``cispo_clip_ratio``) or None. ``ratio_in_weight``: TRL takes vLLM's importance ratio
    into the objective's weight instead of multiplying the loss by it (VESPO)."""

    preset: str
    normalizer: str
    clip_metrics: str | None
    ratio_in_weight: bool = False


# TRL 1.16's loss types (docs/options.md has what each maps onto).
TRL_LOSS_TYPES = {
    "grpo": TrlLossType("grpo", "responses", "region"),
    "bnpo": TrlLossType("bnpo", "tokens", "region"),
    "dr_grpo": TrlLossType("dr_grpo", "responses", "region"),
    "dapo": TrlLossType("dapo", "items", "region"),
    "cispo": TrlLossType("cispo", "items", "cispo"),
    "sapo": TrlLossType("sapo", "responses", None),
    "luspo": TrlLossType("luspo", "responses", "region"),
    "vespo": TrlLossType("vespo", "items", None, ratio_in_weight=True),
}

# The objectives' options (LossConfig fields) and the GRPOConfig fields TRL reads them from;
# a loss type takes those of its objective. CISPO's cap is epsilon_high (epsilon when unset).
TRL_OBJECTIVE_OPTIONS = {
    "delta": "delta",
    "ratio_cap": "resolved_epsilon_high",
    "sapo_temperature_pos": "sapo_temperature_pos",
    "sapo_temperature_neg": "sapo_temperature_neg",
    "vespo_k_pos": "vespo_k_pos",
    "vespo_lambda_pos": "vespo_lambda_pos",
    "vespo_k_neg": "vespo_k_neg",
    "vespo_lambda_neg": "vespo_lambda_neg",
}

# Inputs TRL's GRPOTrainer passes to vision-language backbones.
MULTIMODAL_INPUTS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes", "token_type_ids",
    "mm_token_type_ids", "image_position_ids",
)

# Text-config fields with which a model scales or soft-caps its logits before the
# softmax; the fused loss forms softmax(h W^T / temperature) only.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


def vespo_behaviour_logprobs(old_logprobs: torch.Tensor, importance_sampling_ratio: torch.Tensor) -> torch.Tensor:
    """TRL's VESPO takes vLLM's importance-sampling ratio into its sequence weight (log w gains
    each token's log ratio, clamped to [log 1e-8, 20]) instead of multiplying the loss by it:
    the same weight comes from behaviour log-probs lowered by that log ratio. Equal while a
    token's log-ratio plus its log ratio stays within the +-20 clamp (docs/math.md,
    "Where the hosts differ")."""
    return old_logprobs - importance_sampling_ratio.log().clamp(VESPO_LOG_WEIGHT_MIN, LOG_RATIO_CLAMP)


@dataclass
class HADWGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`HADWGRPOTrainer`]: [`~trl.GRPOConfig`] and the HA-DW fields.

    Parameters:
        > Parameters that control HA-DW

        use_hadw (`bool`, *optional*, defaults to `True`):
            Multiply the advantages by Phi, from the difficulty anchor. With `False` the trainer runs TRL's loss
            with the fused kernel only.
        hadw_lambda_scale (`float`, *optional*, defaults to `1.3`):
            Phi's scale lambda (the paper's best; the authors' code uses 1.5).
        hadw_advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            The baseline of each completion's advantage (docs/math.md, section 2a): `"grpo"` (TRL's group mean,
            scaled as `scale_rewards` says), `"rloo"`, `"james_stein"` or `"prompt_history"` (each r - b, not
            scaled: `scale_rewards` applies to the group mean alone). Phi multiplies it with `use_hadw=True`.
        hadw_history_discount (`float`, *optional*, defaults to `0.9`):
            `"prompt_history"`'s discount per generation batch.
        hadw_history_prior_strength (`float`, *optional*, defaults to `2.0`):
            `"prompt_history"`'s prior strength (pseudo-responses at the mean reward seen so far).
        hadw_anchor_rule (`str`, *optional*, defaults to `"kalman"`):
            `"kalman"` (an IMM bank of Kalman filters on the accuracy's level and slope, mixed by their evidence;
            it ignores eta, eta_min and window), `"soft"` (the paper's rule: a gain from the spread of recent
            beliefs) or `"hard"` (mean of the last window batches).
        hadw_anchor_eta (`float`, *optional*, defaults to `50.0`):
            Gain of the soft rule.
        hadw_anchor_window (`int`, *optional*, defaults to `10`):
            Beliefs in the soft rule's spread, or batches in the hard rule's mean.
        hadw_anchor_eta_min (`float`, *optional*, defaults to `0.05`):
            Floor of the soft rule's gain, which keeps the anchor from freezing (0 is the paper's rule).
        hadw_anchor_belief (`str`, *optional*, defaults to `"prior"`):
            `"prior"` (the belief before the batch, the paper) or `"posterior"` (the authors' code).
        hadw_anchor_initial (`float` or `None`, *optional*, defaults to `None`):
            First belief; `None` takes the first batch's mean reward.

        > Parameters that control the fused loss

        hadw_backend (`str`, *optional*, defaults to `"auto"`):
            `"auto"`, `"torch"`, `"triton"` or `"cpp"`.
        hadw_linear_path (`str`, *optional*, defaults to `"auto"`):
            `"auto"`, `"gradients_in_forward"` or `"recompute"`; under DeepSpeed ZeRO-3, `"auto"` means
            `"gradients_in_forward"`, whose backward does not read the gathered LM head again.
        hadw_block_rows (`int` or `None`, *optional*, defaults to `None`):
            Rows whose logits are held at once; `None` is the backend's default.

        > Parameters that control the model's forwards

        hadw_layout (`str`, *optional*, defaults to `"auto"`):
            How prompts and completions are fed to the model in the training forward and in the forwards of the
            old and reference log-probs: `"padded"` (TRL's own rows), `"packed"` (every prompt and completion in
            one row, no padding), `"shared_prompt"` (packed, each prompt laid out once for its completions in a
            forward), `"prefix_tree"` (packed, every run of tokens the rows of a forward share laid out once: a
            system prompt common to every prompt, a prompt, completions that begin alike) or `"auto"`
            (`"prefix_tree"` where the segment attention serves the model, else `"padded"`; checked when the
            trainer is built). Vision-language inputs stay padded.
        hadw_shuffle (`str`, *optional*, defaults to `"auto"`):
            How a generation batch is shuffled before it is split into micro-batches: `"rows"` (TRL's),
            `"groups"` (whole groups of one prompt, so that a shared-prompt forward holds a group's completions
            together) or `"auto"` (`"groups"` under a layout that shares prompts where that changes no optimizer
            step:
            each step takes a whole generation batch, `steps_per_generation == gradient_accumulation_steps`, and
            the loss type is not `"bnpo"`, which divides each micro-batch by its own tokens; else `"rows"`).
    """

    use_hadw: bool = field(default=True, metadata={"help": "Multiply the advantages by the HA-DW weight Phi."})
    hadw_lambda_scale: float = field(default=DEFAULT_LAMBDA_SCALE, metadata={"help": "Phi's scale lambda."})
    hadw_advantage_estimator: str = field(default="grpo", metadata={
        "help": "The advantage's baseline: 'grpo', 'rloo', 'james_stein' or 'prompt_history'."})
    hadw_history_discount: float = field(default=DEFAULT_DISCOUNT, metadata={
        "help": "prompt_history's discount per generation batch."})
    hadw_history_prior_strength: float = field(default=DEFAULT_PRIOR_STRENGTH, metadata={
        "help": "prompt_history's prior strength."})
    hadw_anchor_rule: str = field(default=DEFAULT_RULE, metadata={"help": "Anchor rule: 'kalman', 'soft' or 'hard'."})
    hadw_anchor_eta: float = field(default=DEFAULT_ETA, metadata={"help": "Gain of the soft anchor rule."})
    hadw_anchor_window: int = field(default=DEFAULT_WINDOW, metadata={"help": "Window of the anchor rules."})
    hadw_anchor_eta_min: float = field(default=DEFAULT_ETA_MIN, metadata={"help": "Floor of the soft rule's gain."})
    hadw_anchor_belief: str = field(default="prior", metadata={"help": "Belief Phi uses: 'prior' or 'posterior'."})
    hadw_anchor_initial: float | None = field(default=None, metadata={"help": "First belief; None: first batch."})
    hadw_backend: str = field(default="auto", metadata={"help": "Backend of the fused loss."})
    hadw_linear_path: str = field(default="auto", metadata={"help": "Linear path of the fused loss."})
    hadw_block_rows: int | None = field(default=None, metadata={"help": "Rows whose logits are held at once."})
    hadw_layout: str = field(default="auto", metadata={
        "help": "The model's forwards: 'padded', 'packed', 'shared_prompt', 'prefix_tree' or 'auto'."})
    hadw_shuffle: str = field(default="auto", metadata={
        "help": "Shuffle a generation batch by 'rows', 'groups' or 'auto'."})

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type not in TRL_LOSS_TYPES:
            hint = (": TRL's GSPO is loss_type='grpo' with importance_sampling_level='sequence'"
                    if self.loss_type == "gspo" else "")
            raise ValueError(f"HADWGRPOTrainer runs loss_type in {sorted(TRL_LOSS_TYPES)}, got "
                             f"{self.loss_type!r}{hint}")
        cap = self.objective_options().get("ratio_cap")
        if cap is not None and not cap > 0:
            raise ValueError(f"loss_type={self.loss_type!r} reads epsilon_high as the cap on its detached importance "
                             f"ratio: epsilon_high={cap} caps every weight at {cap} or below, which trains nothing; "
                             "set epsilon_high=5.0, TRL's recommended value")
        if self.cap_below_one is not None:
            # TRL leaves epsilon_high at epsilon (0.2) unless set; stock TRL runs it, so the drop-in does.
            warnings.warn(
                f"loss_type={self.loss_type!r} reads epsilon_high as the cap on its detached importance ratio: "
                f"epsilon_high={cap} caps every weight at {cap}, so the loss is about {cap} times the ratio-free "
                "policy gradient, as stock TRL's is (TRL leaves epsilon_high at epsilon unless set); set "
                "epsilon_high=5.0, TRL's recommended value, for CISPO's importance weights", UserWarning, stacklevel=3)
            correcting = self.use_vllm and self.vllm_importance_sampling_correction
            if self.off_policy_mask_threshold is not None and correcting:
                # The loss reads vLLM's log-probs for both; see cap_below_one.
                raise ValueError(
                    f"loss_type={self.loss_type!r} with epsilon_high={cap} below 1, off_policy_mask_threshold and "
                    "vllm_importance_sampling_correction: the fused loss takes a cap below 1 by shifting the old and "
                    "vLLM's log-probs by its log, which the off-policy mask would then read; set epsilon_high to 1 or "
                    "more, or drop one of the two")
        # The loss's own checks of these options (temperatures, gamma shapes, clip range),
        # and of its linear path, which the first step would otherwise raise after generating.
        loss_config = LossConfig.build(
            TRL_LOSS_TYPES[self.loss_type].preset, **self.loss_choices(),
            top_entropy_quantile=self.top_entropy_quantile, off_policy_mask_threshold=self.off_policy_mask_threshold,
            **self.kl_options())
        if self.hadw_linear_path == "gradients_in_forward":
            refuse_gradients_in_forward(loss_config, option="hadw_linear_path")
        if (TRL_LOSS_TYPES[self.loss_type].ratio_in_weight and loss_config.kl_bias_correction
                and self.use_vllm and self.vllm_importance_sampling_correction):
            # The loss takes vLLM's ratio into VESPO's weight through the old log-probs
            # (vespo_behaviour_logprobs), which TRL's KL weight does not read.
            raise ValueError(
                f"loss_type={self.loss_type!r} with vllm_importance_sampling_correction and use_bias_correction_kl "
                "(beta != 0): TRL weighs the KL by the ratio to the old log-probs, which the fused loss replaces by "
                "vLLM's to put its correction into VESPO's weight; set use_bias_correction_kl=False or "
                "vllm_importance_sampling_correction=False")
        # The library's own checks, here so a bad value fails when the config is built
        # rather than at the first loss (TRL checks none of these fields).
        check_finite_positive("hadw_lambda_scale", self.hadw_lambda_scale)
        check_backend_name(self.hadw_backend, "hadw_backend")
        check_linear_path(self.hadw_linear_path, "hadw_linear_path")
        check_block_rows(self.hadw_block_rows, "hadw_block_rows")
        check_layout_name("hadw_layout", self.hadw_layout)
        if self.hadw_shuffle not in ("auto", "rows", "groups"):
            raise ValueError(f"unknown hadw_shuffle {self.hadw_shuffle!r}; choose 'auto', 'rows' or 'groups'")
        estimator = estimator_row(self.hadw_advantage_estimator)
        try:
            self.history()
        except ValueError as error:
            raise ValueError(f"hadw_history_{error}") from None
        if not estimator.group_mean and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(f"hadw_advantage_estimator={self.hadw_advantage_estimator!r} forms each completion's "
                             "baseline from the rewards, which needs multi_objective_aggregation='sum_then_normalize' "
                             "(one reward per completion)")
        try:
            self.anchor()  # DifficultyAnchor checks the rule, gains, window, belief, initial
        except (TypeError, ValueError) as error:
            raise ValueError(f"hadw_anchor_*: {error}") from None
        refused = {
            # TRL's bonus is a token mean of its own, not aggregated as the loss is.
            "entropy_coef != 0 or use_adaptive_entropy": self.entropy_coef != 0.0 or self.use_adaptive_entropy,
        }
        named = [name for name, given in refused.items() if given]
        if named:
            raise ValueError(f"HADWGRPOTrainer's fused loss does not implement {', '.join(named)}")
        if self.use_hadw and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "HA-DW compares each group's mean reward with the anchor, which needs "
                "multi_objective_aggregation='sum_then_normalize' (one reward per response)"
            )

    @property
    def cap_below_one(self) -> float | None:
        """CISPO's cap where it lies below 1 (TRL's default epsilon_high, 0.2), else None.
        The loss's own cap is at least 1, so the trainer hands it TRL's min(r, c) as
        c min(r / c, 1): the advantages times c, the old (and vLLM's) log-probs shifted by
        log c, a cap of 1, and the bias-corrected KL's beta times c (its ratio is r / c)."""
        cap = self.objective_options().get("ratio_cap")
        return cap if cap is not None and 0 < cap < 1 else None

    @property
    def resolved_epsilon_high(self) -> float:
        """epsilon_high as TRL reads it: epsilon when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def objective_options(self) -> dict:
        """TRL's options that the loss type's objective reads, as LossConfig fields."""
        objective = LOSS_PRESETS[TRL_LOSS_TYPES[self.loss_type].preset].objective
        return {name: getattr(self, field) for name, field in TRL_OBJECTIVE_OPTIONS.items()
                if name in OBJECTIVES[objective].options}

    def kl_options(self) -> dict:
        """TRL's bias-corrected KL (its default; it acts only with beta != 0) as the loss's
        options. TRL weighs each token's KL by its importance weight at the configured level:
        at "token" each token's own ratio, even where VESPO's ratio is per response."""
        corrected = self.beta != 0.0 and self.use_bias_correction_kl
        token = corrected and self.importance_sampling_level != "sequence"
        return dict(kl_bias_correction=corrected, kl_bias_ratio="token" if token else "objective")

    def loss_choices(self) -> dict:
        """The loss type's ratio form, clip range and objective options as the fused loss's
        options (the batch counts come per micro-batch). TRL's sequence level is the
        ratio form whose gradient reaches each token through the response's ratio; an
        objective that reads whole responses (VESPO) keeps its own form at either level."""
        objective = LOSS_PRESETS[TRL_LOSS_TYPES[self.loss_type].preset].objective
        ratio_level = "sequence" if self.importance_sampling_level == "sequence" else "token"
        options = self.objective_options()
        if self.cap_below_one is not None:
            options["ratio_cap"] = 1.0
        # An objective with a cap has no clip range: clip_frac_high then counts the ratios
        # above the cap with A > 0, TRL's cispo_clip_ratio.
        epsilon_high = self.resolved_epsilon_high if "ratio_cap" not in options else options["ratio_cap"] - 1
        return dict(
            ratio_level=ratio_level if ratio_level in OBJECTIVES[objective].ratio_levels else None,
            epsilon_low=self.epsilon, epsilon_high=epsilon_high, beta=self.beta, **options,
        )

    def history(self) -> PromptHistory:
        """The prompts' history these fields describe."""
        return PromptHistory(discount=self.hadw_history_discount, prior_strength=self.hadw_history_prior_strength)

    def anchor(self) -> DifficultyAnchor:
        """The difficulty anchor these fields describe."""
        return DifficultyAnchor(
            self.hadw_anchor_rule, eta=self.hadw_anchor_eta, window=self.hadw_anchor_window,
            eta_min=self.hadw_anchor_eta_min, belief=self.hadw_anchor_belief, initial=self.hadw_anchor_initial,
        )


class HADWGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with HA-DW and the fused linear loss; takes the same
    arguments, with ``args`` a :class:`HADWGRPOConfig`. ``self.anchor`` is the
    difficulty anchor (None with ``use_hadw=False``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, HADWGRPOConfig):
            raise TypeError(f"HADWGRPOTrainer needs args=HADWGRPOConfig(...), got {type(self.args).__name__}")
        try:  # on the device training runs on, not at the first step after generating
            resolve_backend(self.args.hadw_backend, self.accelerator.device)
        except BackendUnavailable as error:
            raise ValueError(f"hadw_backend={self.args.hadw_backend!r}: {error}") from None
        if self.aux_loss_enabled:
            raise ValueError("HADWGRPOTrainer's fused loss does not add the MoE router auxiliary loss "
                             "(set router_aux_loss_coef=0)")
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if is_peft_model(model) else model
        if hasattr(model.get_output_embeddings(), "base_layer"):
            raise ValueError("the LM head carries a PEFT adapter, which the fused loss (reading the head's weight) "
                             "would ignore: leave lm_head out of the adapter's target modules")
        text_config = model.config.get_text_config()
        transforms = {name: getattr(text_config, name, None) for name in LOGIT_TRANSFORMS}
        transforms = {name: value for name, value in transforms.items() if value not in (None, 1, 1.0)}
        if transforms:
            raise ValueError(f"this model transforms its logits ({transforms}), which the fused loss does not")
        self.anchor = self.args.anchor() if self.args.use_hadw else None
        self.estimator = ESTIMATORS[self.args.hadw_advantage_estimator]
        self.history = self.args.history() if self.estimator.scope == "history" else None
        self._forward_redirection = _ForwardRedirection()
        self._gathered_rewards_per_func = None
        self.layout, because = self._choose_layout(model)
        logger.info("HADWGRPOTrainer: the model's forwards in the %s layout (%s)", self.layout.name, because)
        shuffle = self.args.hadw_shuffle
        if shuffle == "auto":
            shuffle = "groups" if self.layout.shares_prompts and self._steps_see_whole_generation_batches() else "rows"
        self.shuffles_groups = shuffle == "groups"

    def _steps_see_whole_generation_batches(self) -> bool:
        """Whether every optimizer step takes a whole generation batch and weighs each
        micro-batch's rows by counts that do not depend on which rows it holds: then how
        the batch is shuffled changes no step (docs/integrations/trl.md, "Layouts")."""
        whole = self.args.steps_per_generation == self.args.gradient_accumulation_steps
        return whole and TRL_LOSS_TYPES[self.loss_type].normalizer != "tokens"

    def _choose_layout(self, model) -> tuple:
        """(layout, why) by the library's rule (``layouts.choose_layout``) on the policy and
        the reference model; vision-language inputs stay padded."""
        wanted = self.args.hadw_layout
        if self._is_vlm and wanted != "padded":
            if wanted != "auto":
                raise ValueError(f"hadw_layout={wanted!r}: vision-language inputs stay padded (their image tokens and "
                                 "pixel values are laid out per row); use hadw_layout='padded' or 'auto'")
            return LAYOUTS["padded"], "vision-language inputs stay padded"
        models = [model]
        if self.ref_model is not None:
            reference = self.accelerator.unwrap_model(self.ref_model)
            models.append(reference.get_base_model() if is_peft_model(reference) else reference)
        # Under ZeRO-3 the weights are partitioned until the engine runs: no trial forward.
        layout, reason, fallback = choose_layout(models, wanted, option="hadw_layout",
                                                 check=not is_deepspeed_zero3_enabled())
        if fallback is not None:
            # A warning, not the INFO line: neither TRL's nor transformers' verbosity shows this module's logger.
            warnings.warn(f"hadw_layout='auto' feeds this model padded rows: {fallback}. Its forwards cost what stock "
                          "TRL's do; shared runs of tokens are laid out once only for a model the segment attention "
                          "serves (sdpa attention without sliding windows, say; docs/layouts.md)", UserWarning,
                          stacklevel=3)
        return layout, reason

    # -- the layouts ----------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch):
        """TRL's, with each generation batch shuffled by whole groups instead of rows when
        ``shuffles_groups`` (docs/integrations/trl.md, "Layouts"): the micro-batches then
        hold a group's completions together, which the shared-prompt layout feeds once."""
        if not (self.shuffles_groups and self.model.training):
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = split_pixel_values_by_grid(generation_batch)
            generation_batch = _shuffled_by_group(generation_batch)
            batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _laid_out(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> LaidOutBatch:
        """TRL's rows (left-padded prompts, right-padded completions) in the packed layout."""
        return self.layout.build(*_rows(prompt_ids, prompt_mask, completion_ids, completion_mask),
                                 device=completion_ids.device)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's, in the packed layouts: the old and reference log-probs (and entropies)
        from the backbone and the LM head without logits, back in TRL's [B, logits_to_keep],
        in as many forwards of ``batch_size`` rows as TRL's, each prompt's completions
        together."""
        if not self.layout.packs or any(value is not None for value in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        prompts, completions = _rows(input_ids[:, :-logits_to_keep], attention_mask[:, :-logits_to_keep],
                                     input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:])
        unwrapped = self.accelerator.unwrap_model(model)
        unwrapped = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
        lm_head = unwrapped.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        logps = input_ids.new_zeros(input_ids.shape[0], logits_to_keep, dtype=torch.float32)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        for rows in _forwards_of(prompts, batch_size or input_ids.shape[0]):
            batch = self.layout.build([prompts[row] for row in rows], [completions[row] for row in rows],
                                      device=input_ids.device)
            with self.accelerator.autocast():
                hidden = unwrapped.base_model(**batch.model_inputs(unwrapped), use_cache=False).last_hidden_state
            hidden = batch.loss_hidden_states(hidden).to(device=weight.device, dtype=weight.dtype)
            with torch.autocast(weight.device.type, enabled=False), maybe_gather_lm_head_ctx(weight, bias):
                values = token_logprobs(hidden, weight, batch.labels, temperature=self.temperature, lm_head_bias=bias,
                                        with_entropy=compute_entropy, backend=self.args.hadw_backend)
            values = values if compute_entropy else (values,)
            index = torch.tensor(rows, device=logps.device)
            for out, value in zip((logps, entropies), values):
                out[index] = batch.to_padded(value.float(), logits_to_keep)
        return logps, entropies, None

    # -- HA-DW on the advantages ------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL gathers every process's rewards here: keep them for Phi and the estimators.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.anchor is not None or not self.estimator.group_mean:
            self._gathered_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.anchor is None and self.estimator.group_mean:
            return output
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        rewards_per_func, self._gathered_rewards_per_func = self._gathered_rewards_per_func, None
        # TRL's reward: the weighted sum over reward functions; NaN where none scored.
        weighted = rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = weighted.nansum(dim=1).masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))
        if self.anchor is not None or self.history is not None:
            require_unit_interval(
                rewards, "scale each reward function into [0, 1] and give reward_weights that sum to 1"
            )
        scored = rewards[~torch.isnan(rewards)]
        if self.anchor is not None and mode == "train" and scored.numel() > 0:
            # Once per generation batch, from every process's rewards (TRL gathered them, so
            # no all-reduce here). The kalman rule weighs y_t by its count and variance.
            mean, variance, count = batch_reward_statistics(scored, all_reduce=False)
            self.anchor.observe(mean, count=count, variance=variance)
        belief = None if self.anchor is None else self.anchor.value
        if group_size < 2 or (belief is None and self.estimator.group_mean):
            return output  # no group to compare with; or no belief yet, and TRL's advantages stand
        # An unscored response takes its group's mean: it leaves the group mean as TRL's
        # nanmean has it, and its advantage stays 0.
        unscored = torch.isnan(rewards)
        group_means = torch.nanmean(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size)
        rewards = torch.where(unscored, group_means, rewards)
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        phi = None if belief is None else hadw_weights(rewards, group_size, belief,
                                                       lambda_scale=self.args.hadw_lambda_scale)
        if self.estimator.group_mean:
            output["advantages"] = output["advantages"] * phi[local].to(output["advantages"].dtype)
        else:
            advantages = hadw_advantages(rewards, group_size=group_size, estimator=self.estimator.name,
                                         anchor=belief, lambda_scale=self.args.hadw_lambda_scale,
                                         prior=self._history_prior(output, rewards, mode))
            advantages = advantages.masked_fill(unscored, 0.0)
            output["advantages"] = advantages[local].to(output["advantages"].dtype)
            self._metrics[mode]["hadw/advantage_abs_mean"].append(advantages.abs().mean().item())
        if phi is not None:
            self._metrics[mode]["hadw/anchor"].append(belief)
            self._metrics[mode]["hadw/phi_mean"].append(phi.mean().item())
        return output

    def _history_prior(self, output, rewards: torch.Tensor, mode: str) -> torch.Tensor | None:
        """Each completion's (alpha, beta) of its prompt, read before this generation batch
        (every process's: the history folds in the gathered batch, so it is the same on
        every process); the batch is folded in once, in training. Prompts are keyed by
        their tokens."""
        if self.history is None:
            return None
        keys = [prompt_key(ids[mask.bool()]) for ids, mask in zip(output["prompt_ids"], output["prompt_mask"])]
        keys = gather_object(keys)
        if mode != "train":
            return self.history.read(keys).to(rewards.device)
        return self.history.update(rewards, keys, all_gather=False)

    # -- the fused loss -------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        # The backbone, the LM head and the loss run inside the wrapped model's forward
        # (DDP's gradient hooks, FSDP and ZeRO-3 gathering), as TRL's fused losses do;
        # the metrics' collectives run after it.
        mode = "train" if self.model.training else "eval"
        unwrapped = self.accelerator.unwrap_model(model)
        loss, metrics, counts = self._forward_redirection(model, unwrapped, self._fused_loss, unwrapped, inputs, mode)
        self._log_loss_metrics(metrics, counts, mode)
        return loss

    def _fused_loss(self, unwrapped, inputs, mode):
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:  # tool outputs inside a completion are not the policy's tokens
            mask = mask & inputs["tool_mask"].bool()
        multimodal = {key: inputs[key] for key in MULTIMODAL_INPUTS if key in inputs}
        batch = None
        if self.layout.packs and not multimodal:
            batch = self._laid_out(inputs["prompt_ids"], inputs["prompt_mask"], completion_ids,
                                   inputs["completion_mask"])
        fed_tokens = inputs["prompt_ids"].numel() + completion_ids.numel() if batch is None else batch.fed_tokens
        model = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
        # The decoder without the LM head, in TRL's mixed precision.
        with self.accelerator.autocast():
            if batch is None:  # TRL's own rows: position t's hidden state predicts token t + 1
                hidden_states = model.base_model(
                    input_ids=torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
                    attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                    use_cache=False, **multimodal,
                ).last_hidden_state[:, -completion_ids.size(1) - 1 : -1]
            else:
                hidden_states = batch.loss_hidden_states(
                    model.base_model(**batch.model_inputs(model), use_cache=False).last_hidden_state)
        lm_head = model.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        if isinstance(weight, DTensor):  # FSDP2 shards; the loss needs the whole head
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        # The head's dtype (fp32 under cast_lm_head_to_fp32 or fp32 master weights): the
        # kernels accumulate in fp32 whatever it is, outside autocast.
        hidden_states = hidden_states.to(device=weight.device, dtype=weight.dtype)
        linear_path = self.args.hadw_linear_path
        options = self._loss_options(inputs, mask, mode)
        if linear_path == "auto" and is_deepspeed_zero3_enabled():
            reading = [name for name, value in (("use_bias_correction_kl", options["kl_bias_correction"]),
                                                ("off_policy_mask_threshold", options["off_policy_mask_threshold"]),
                                                ("top_entropy_quantile < 1", options["top_entropy_quantile"] < 1))
                       if value]
            if reading:
                # Under ZeRO-3 the gathered head is released after the forward, so the
                # gradients are formed there; these read the batch's log-probs first.
                raise ValueError(f"under DeepSpeed ZeRO-3 the fused loss forms its gradients in the forward, before "
                                 f"the batch's log-probs are known, which {', '.join(reading)} read: turn them off "
                                 "(use_bias_correction_kl=False), or train under ZeRO-2")
            linear_path = "gradients_in_forward"
        old_logprobs, behaviour = self._behaviour(inputs)
        advantages, cap = inputs["advantages"], self.args.cap_below_one
        if cap is not None:
            old_logprobs, behaviour, advantages = _under_cap(cap, old_logprobs, behaviour, advantages, options)
        per_token = dict(labels=completion_ids, old_logprobs=old_logprobs, response_mask=mask,
                         ref_logprobs=inputs.get("ref_per_token_logps"), advantages=advantages, **behaviour)
        if batch is not None:  # TRL's [B, T] and [B] tensors in the layout's
            per_token = {name: _in_layout(batch, value) for name, value in per_token.items()}
            per_token["labels"] = batch.labels
        with torch.autocast(weight.device.type, enabled=False), maybe_gather_lm_head_ctx(weight, bias):
            loss, metrics = fused_linear_hadw_grpo_loss(
                hidden_states, weight, per_token.pop("labels"), per_token.pop("old_logprobs"), None,
                per_token.pop("response_mask"), cu_seqlens=None if batch is None else batch.cu_seqlens,
                lm_head_bias=bias, temperature=self.temperature, **per_token, return_metrics=True,
                backend=self.args.hadw_backend, linear_path=linear_path, block_rows=self.args.hadw_block_rows,
                **options,
            )
        sequence = self.importance_sampling_level == "sequence"
        if cap is not None and old_logprobs is None:
            # TRL's ratio is 1 here (on-policy), above the cap: every A > 0 counts as capped.
            metrics["clip_frac_high"] = _positive_share(inputs["advantages"], mask, sequence)
        elif cap is not None and options["kl_bias_correction"]:
            metrics["ref_kl"] = metrics["ref_kl"] * cap  # the corrected estimate's ratio was r / c
        counts = mask.any(dim=1).sum() if sequence else mask.sum()
        return loss, metrics, (mask.sum(), counts, fed_tokens)

    def _loss_options(self, inputs, mask, mode) -> dict:
        """TRL's loss type, its options, KL and normalisation as the fused loss's options."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        loss_type = TRL_LOSS_TYPES[self.loss_type]
        if loss_type.normalizer == "responses":
            normalizer = mask.shape[0] * accumulation
        elif loss_type.normalizer == "tokens":
            normalizer = max(int(mask.sum()), 1) * accumulation
        elif loss_type.normalizer == "items":  # spans the generation batch, over all processes
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0).item() / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
        else:
            raise ValueError(f"TRL normalizer {loss_type.normalizer!r} has no meaning here")
        return dict(
            loss_type=loss_type.preset,
            **self.args.loss_choices(),
            kl_estimator="k3",
            **self.args.kl_options(),
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            top_entropy_quantile=self.top_entropy_quantile,
            # TRL takes the quantile of the entropies rounded to float32 (its own mask's).
            entropy_mask_dtype="float32",
            loss_normalizer=normalizer,
            # Dr.GRPO's constant length, where the aggregation divides by one.
            max_response_length=(self.max_completion_length
                                 if AGGREGATIONS[LOSS_PRESETS[loss_type.preset].loss_agg_mode].times_max_length
                                 else None),
        )

    def _behaviour(self, inputs):
        """(old log-probs, the loss's rollout keywords). vLLM's log-probs go to the loss,
        which forms TRL's importance-sampling ratio from them in the configured mode (a
        token vLLM did not score, NaN, takes the old log-prob: ratio 1, as TRL's) and reads
        them for the off-policy mask; VESPO takes TRL's ratio into its weight through the old
        log-probs instead."""
        old_logprobs = inputs.get("old_per_token_logps")
        correcting = self.use_vllm and self.vllm_importance_sampling_correction
        if correcting and TRL_LOSS_TYPES[self.loss_type].ratio_in_weight:
            # TRL computes the old log-probs whenever it corrects vLLM's sampling, and allows
            # only the per-token modes here.
            return vespo_behaviour_logprobs(old_logprobs, inputs["importance_sampling_ratio"]), {}
        sampling = inputs.get("sampling_per_token_logps")
        reads_sampling = correcting or self.off_policy_mask_threshold is not None
        if sampling is None or not reads_sampling:
            return old_logprobs, {}
        if old_logprobs is not None:
            sampling = torch.where(torch.isnan(sampling), old_logprobs, sampling)
        behaviour = {"rollout_logprobs": sampling}
        if correcting:
            behaviour["rollout_correction"] = RolloutCorrection.from_trl(
                self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max)
        return old_logprobs, behaviour

    def _log_loss_metrics(self, metrics, counts, mode):
        """TRL's loss metrics (names and global token-weighted means) from the fused loss's,
        and the tokens this process's layout fed the model (``hadw/fed_tokens``, a host
        count: where a user looks for the layout's effect)."""
        tokens, ratio_units, fed_tokens = counts
        self._metrics[mode]["hadw/fed_tokens"].append(float(fed_tokens))

        def global_mean(value, count):
            totals = self.accelerator.reduce(torch.stack([value.float() * count, count.float()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        self._metrics[mode]["entropy"].append(global_mean(metrics["entropy_mean"], tokens))
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_mean(metrics["ref_kl"], tokens))
        clip_metrics = TRL_LOSS_TYPES[self.loss_type].clip_metrics
        if clip_metrics == "region":
            low = global_mean(metrics["clip_frac_low"], ratio_units)
            high = global_mean(metrics["clip_frac_high"], ratio_units)
            self._metrics[mode]["clip_ratio/low_mean"].append(low)
            self._metrics[mode]["clip_ratio/high_mean"].append(high)
            self._metrics[mode]["clip_ratio/region_mean"].append(low + high)
        elif clip_metrics == "cispo":  # clip_frac_high counts over the cap (HADWGRPOConfig.loss_choices)
            self._metrics[mode]["cispo_clip_ratio"].append(global_mean(metrics["clip_frac_high"], ratio_units))

    # -- the anchor in TRL's checkpoints ----------------------------------------------

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        folder = os.path.join(self._get_output_dir(trial=trial), checkpoint)
        for name, state in self._states().items():
            path = os.path.join(folder, name)
            with open(path + ".partial", "w") as handle:
                json.dump(state.state_dict(), handle)
            os.replace(path + ".partial", path)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        for name, state in self._states().items():
            path = os.path.join(checkpoint, name)
            if not os.path.exists(path):
                logger.warning("resuming from %s, which holds no %s: it starts afresh", checkpoint, name)
                continue
            with open(path) as handle:
                state.load_state_dict(json.load(handle))

    def _states(self) -> dict:
        """The state each checkpoint folder holds beside TRL's, by file name."""
        states = {ANCHOR_FILE: self.anchor, HISTORY_FILE: self.history}
        return {name: state for name, state in states.items() if state is not None}


def _under_cap(cap: float, old_logprobs, behaviour: dict, advantages, options: dict):
    """(old log-probs, rollout keywords, advantages) that give TRL's CISPO weight
    min(r, cap), a cap below 1, as the loss's cap of 1 on r / cap
    (HADWGRPOConfig.cap_below_one); ``options``' beta follows the bias-corrected KL's ratio."""
    advantages = advantages * cap
    if old_logprobs is None:  # on-policy: TRL's ratio is 1 and the loss's too, min(1, cap) = cap
        return old_logprobs, behaviour, advantages
    shift = math.log(cap)
    behaviour = dict(behaviour)
    if options["off_policy_mask_threshold"] is not None:
        # The mask reads its log-probs as they are (with vLLM's correction, which would
        # need them shifted, the config refuses a cap below 1).
        behaviour.setdefault("rollout_logprobs", old_logprobs)
    elif "rollout_logprobs" in behaviour:  # vLLM's correction reads exp(old - rollout): both shifted
        behaviour["rollout_logprobs"] = behaviour["rollout_logprobs"] + shift
    if options["kl_bias_correction"]:
        options["beta"] = options["beta"] * cap
    return old_logprobs + shift, behaviour, advantages


def _positive_share(advantages: torch.Tensor, mask: torch.Tensor, sequence: bool) -> torch.Tensor:
    """The share of the ratios' units (the valid tokens, or at sequence level the
    responses with one) whose advantage is positive."""
    positive = (advantages[:, None] if advantages.dim() == 1 else advantages) > 0
    positive = positive & mask
    if sequence:
        return positive.any(dim=1).sum() / mask.any(dim=1).sum().clamp(min=1)
    return positive.sum() / mask.sum().clamp(min=1)


def _in_layout(batch: LaidOutBatch, value):
    """A TRL per-row tensor in ``batch``'s layout: [B] per response in the order of its
    segments, [B, T] per token in its positions; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return batch.per_segment(value) if value.dim() == 1 else batch.from_padded(value)


def _rows(prompt_ids, prompt_mask, completion_ids, completion_mask) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt tokens (TRL left-pads them) and completion tokens (right-padded),
    as lists for a layout: one host read of the ids and masks."""
    return _unpadded(prompt_ids, prompt_mask, left=True), _unpadded(completion_ids, completion_mask, left=False)


def _unpadded(ids, mask, *, left: bool) -> list[list[int]]:
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    kept = positions >= mask.shape[1] - lengths[:, None] if left else positions < lengths[:, None]
    if not torch.equal(mask.bool(), kept):
        raise ValueError(
            "the packed layouts take left-padded prompts and right-padded completions (masks a run of ones beside "
            "the padding); a mask with a gap inside a prompt or completion needs hadw_layout='padded'")
    return [row[len(row) - n:] if left else row[:n] for row, n in zip(ids.tolist(), lengths.tolist())]


def _forwards_of(prompts, rows: int) -> list[list[int]]:
    """The rows cut into forwards of ``rows`` rows, as many as TRL's own chunks (under
    ZeRO-3 every rank must run as many forwards), each prompt's rows one after another so
    that a forward holds a group's completions together."""
    ordered = [row for members in rows_by_group(prompt_groups(prompts)) for row in members]
    return [ordered[start:start + rows] for start in range(0, len(ordered), rows)]


def _shuffled_by_group(batch: dict) -> dict:
    """TRL's shuffle of a generation batch (every row-wise value permuted in unison) over
    whole groups, rows of equal prompt tokens, instead of single rows: the groups in a
    random order (torch's generator, as TRL's), each group's rows together."""
    groups = rows_by_group(prompt_groups(_unpadded(batch["prompt_ids"], batch["prompt_mask"], left=True)))
    permutation = [row for group in torch.randperm(len(groups)).tolist() for row in groups[group]]

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[torch.tensor(permutation, device=value.device)]
        return [value[row] for row in permutation]

    return {key: permute(value) for key, value in batch.items()}
