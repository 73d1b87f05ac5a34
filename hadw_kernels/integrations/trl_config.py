"""The TRL drop-in's config, :class:`HADWGRPOConfig` (TRL's ``GRPOConfig`` and the
``hadw_`` fields), and how each of TRL's loss types maps onto the library's objectives
(:data:`TRL_LOSS_TYPES`, and the inputs that give TRL's VESPO weight and CISPO cap below
1); the trainer that reads it is ``trl.py`` (docs/integrations/trl.md)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

from .versions import require_supported

# Before trl itself is imported: an unsupported release fails here, naming the range.
require_supported("trl")

import torch
from trl import GRPOConfig

from ..advantage.anchor import DEFAULT_ETA, DEFAULT_ETA_MIN, DEFAULT_RULE, DEFAULT_WINDOW, DifficultyAnchor
from ..advantage.history import DEFAULT_DISCOUNT, DEFAULT_PRIOR_STRENGTH, PromptHistory
from ..backends import check_backend_name
from ..config.loss_config import DEFAULT_LAMBDA_SCALE, LossConfig
from ..config.presets import LOSS_PRESETS
from ..layouts.choice import check_layout_name
from ..loss import refuse_gradients_in_forward
from ..objectives.table import LOG_RATIO_CLAMP, OBJECTIVES, VESPO_LOG_WEIGHT_MIN
from ..tables.bounds import check_finite_positive
from ..tables.estimators import estimator_row
from ..tables.linear_blocks import check_block_rows, check_linear_path


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
@dataclass
class HADWGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`HADWGRPOTrainer`]: [`~trl.GRPOConfig`] and the HA-DW fields.

    Parameters:
        > Parameters that control HA-DW

        use_hadw (`bool`, *optional*, defaults to `True`):
            Multiply the advantages by Phi, from the difficulty anchor. With `False` the trainer runs TRL's loss
            with the fused kernel only; stock TRL's numbers (an A/B run) also take `hadw_shuffle="rows"`
            (docs/integrations/trl.md, "A/B against stock TRL").
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
        try:
            estimator = estimator_row(self.hadw_advantage_estimator)
        except ValueError as error:
            raise ValueError(f"hadw_advantage_{error}") from None
        try:
            self.history()
        except ValueError as error:
            raise ValueError(f"hadw_history_{error}") from None
        set_apart = [name for name, value, default in (
            ("hadw_history_discount", self.hadw_history_discount, DEFAULT_DISCOUNT),
            ("hadw_history_prior_strength", self.hadw_history_prior_strength, DEFAULT_PRIOR_STRENGTH))
            if value != default]
        if set_apart and estimator.scope != "history":
            raise ValueError(f"{set_apart[0]} is read by hadw_advantage_estimator='prompt_history' alone, not "
                             f"{self.hadw_advantage_estimator!r}")
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


def vespo_behaviour_logprobs(old_logprobs: torch.Tensor, importance_sampling_ratio: torch.Tensor) -> torch.Tensor:
    """TRL's VESPO takes vLLM's importance-sampling ratio into its sequence weight (log w gains
    each token's log ratio, clamped to [log 1e-8, 20]) instead of multiplying the loss by it:
    the same weight comes from behaviour log-probs lowered by that log ratio. Equal while a
    token's log-ratio plus its log ratio stays within the +-20 clamp (docs/math.md,
    "Where the hosts differ")."""
    return old_logprobs - importance_sampling_ratio.log().clamp(VESPO_LOG_WEIGHT_MIN, LOG_RATIO_CLAMP)


def cap_below_one_inputs(cap: float, old_logprobs, behaviour: dict, advantages, options: dict):
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


def positive_share(advantages: torch.Tensor, mask: torch.Tensor, sequence: bool) -> torch.Tensor:
    """The share of the ratios' units (the valid tokens, or at sequence level the
    responses with one) whose advantage is positive."""
    positive = (advantages[:, None] if advantages.dim() == 1 else advantages) > 0
    positive = positive & mask
    if sequence:
        return positive.any(dim=1).sum() / mask.any(dim=1).sum().clamp(min=1)
    return positive.sum() / mask.sum().clamp(min=1)
