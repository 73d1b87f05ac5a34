"""HA-DW and the fused linear loss in TRL's ``GRPOTrainer`` (TRL 1.15 and 1.16, checked on
import: versions.py).

    from .trl import HADWGRPOConfig, HADWGRPOTrainer

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
import os
import warnings

from .versions import require_supported

# Before trl itself is imported: an unsupported release fails here, naming the range.
require_supported("trl")

import torch
from accelerate.utils import gather_object, is_peft_model
from torch.distributed.tensor import DTensor
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import (
    maybe_gather_lm_head_ctx,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from ..advantage.anchor import batch_reward_statistics
from ..advantage.group import estimated_advantages
from ..advantage.history import prompt_key
from ..backends import BackendUnavailable, resolve_backend
from ..config.loss_config import DEFAULT_STD_EPS
from ..config.presets import LOSS_PRESETS
from ..layouts import LAYOUTS, LaidOutBatch, choose_layout
from ..loss import fused_linear_hadw_grpo_loss, token_logprobs
from ..tables.aggregations import AGGREGATIONS
from ..tables.corrections import RolloutCorrection
from ..tables.estimators import ESTIMATORS
from ..tables.precision import accumulate_dtype
from .rewards import require_unit_interval
from .trl_config import TRL_LOSS_TYPES, HADWGRPOConfig, cap_below_one_inputs, positive_share, vespo_behaviour_logprobs
from .trl_rows import forwards_of, in_layout, shuffled_by_group, token_rows_of

logger = logging.getLogger(__name__)

ANCHOR_FILE = "hadw_anchor.json"
HISTORY_FILE = "hadw_history.json"


MULTIMODAL_INPUTS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes", "token_type_ids",
    "mm_token_type_ids", "image_position_ids",
)

# Text-config fields with which a model scales or soft-caps its logits before the
# softmax; the fused loss forms softmax(h W^T / temperature) only.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


def _follow_trainer_verbosity(args) -> None:
    """This module's logger at the level transformers' Trainer gives its own on this process
    (``log_level``, ``log_level_replica``: ``args.get_process_log_level()``, which the Trainer
    passes to ``transformers.logging.set_verbosity``), so that ``log_level="info"`` shows the
    layout the trainer chose. TRL's GRPOTrainer logs through accelerate's ``get_logger``, which
    reads ``ACCELERATE_LOG_LEVEL`` only, and writes warnings alone; a logger outside
    ``transformers`` gets none of transformers' verbosity or its stderr handler. A handler of
    its own only where no logger up the chain has one: a user's logging config (or pytest's)
    receives the lines once, through propagation."""
    logger.setLevel(args.get_process_log_level())
    if not logger.hasHandlers():
        logger.addHandler(logging.StreamHandler())


class HADWGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with HA-DW and the fused linear loss; takes the same
    arguments, with ``args`` a :class:`HADWGRPOConfig`. ``self.anchor`` is the
    difficulty anchor (None with ``use_hadw=False``)."""

    # Declared for the checker (transformers' Trainer holds a TrainingArguments): __init__
    # refuses any other args, so the HADWGRPOConfig fields (TRL's and ours) are there.
    args: HADWGRPOConfig

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
        _follow_trainer_verbosity(self.args)
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
            # A warning as well as the INFO line: it shows at transformers' default verbosity (warning).
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
            generation_batch = shuffled_by_group(generation_batch)
            batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _laid_out(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> LaidOutBatch:
        """TRL's rows (left-padded prompts, right-padded completions) in the packed layout."""
        return self.layout.build(*token_rows_of(prompt_ids, prompt_mask, completion_ids, completion_mask),
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
        prompts, completions = token_rows_of(input_ids[:, :-logits_to_keep], attention_mask[:, :-logits_to_keep],
                                     input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:])
        unwrapped = self.accelerator.unwrap_model(model)
        unwrapped = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
        lm_head = unwrapped.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        logps = input_ids.new_zeros(input_ids.shape[0], logits_to_keep, dtype=torch.float32)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        for rows in forwards_of(prompts, batch_size or input_ids.shape[0]):
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
        fix = "scale each reward function into [0, 1] and give reward_weights that sum to 1"
        if self.anchor is not None:
            require_unit_interval(rewards, fix)
        if self.history is not None:
            require_unit_interval(rewards, fix, reader="hadw_advantage_estimator='prompt_history' (its Beta posterior)")
        scored = rewards[~torch.isnan(rewards)]
        if self.anchor is not None and mode == "train" and scored.numel() > 0:
            # Once per generation batch, from every process's rewards (TRL gathered them, so
            # no all-reduce here). The kalman rule weighs y_t by its count and variance.
            mean, variance, count = batch_reward_statistics(scored, all_reduce=False)
            self.anchor.observe(mean, count=count, variance=variance)
        belief = None if self.anchor is None else self.anchor.value
        if group_size < 2 or (belief is None and self.estimator.group_mean):
            return output  # no group to compare with; or no belief yet, and TRL's advantages stand
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        prior = self._history_prior(output, rewards, mode)
        advantages, phi, counted = self._scored_advantages(rewards, group_size, belief, prior)
        if self.estimator.group_mean:
            output["advantages"] = output["advantages"] * phi[local].to(output["advantages"].dtype)
        else:
            output["advantages"] = advantages[local].to(output["advantages"].dtype)
            self._metrics[mode]["hadw/advantage_abs_mean"].append(advantages.abs().mean().item())
        if belief is not None:
            self._metrics[mode]["hadw/anchor"].append(belief)
            if bool(counted.any()):
                self._metrics[mode]["hadw/phi_mean"].append(phi[counted].mean().item())
        return output

    def _scored_advantages(self, rewards: torch.Tensor, group_size: int, belief: float | None,
                           prior: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A * Phi, Phi, counted) [B] of the gathered batch by the estimator, from the
        scored completions alone (docs/integrations/trl.md, "Unscored completions"): an
        unscored one (NaN) enters no baseline, not even the batch's other groups' under
        james_stein, and gets A = 0 (Phi 1), as does every completion of a group with fewer
        than two scored, which has no group to compare with: stock TRL's 0. ``counted``:
        the completions that entered."""
        groups = torch.arange(rewards.numel(), device=rewards.device) // group_size
        scored = ~torch.isnan(rewards)
        per_group = torch.zeros(rewards.numel() // group_size, device=rewards.device).index_add_(
            0, groups, scored.float())
        counted = scored & (per_group[groups] >= 2)
        advantages, phi = torch.zeros_like(rewards), torch.ones_like(rewards)
        if bool(counted.any()):
            values = rewards[counted].to(accumulate_dtype(rewards.dtype))
            dense = torch.unique(groups[counted], return_inverse=True)[1]
            taken, weights = estimated_advantages(
                values, dense, int(dense.max()) + 1, self.estimator, False, DEFAULT_STD_EPS, belief,
                self.args.hadw_lambda_scale, None if prior is None else prior[counted])
            advantages[counted], phi[counted] = taken.to(rewards.dtype), weights.to(rewards.dtype)
        return advantages, phi, counted

    def _history_prior(self, output, rewards: torch.Tensor, mode: str) -> torch.Tensor | None:
        """Each completion's (alpha, beta) of its prompt, read before this generation batch
        (every process's: the history folds in the gathered batch, so it is the same on
        every process); the batch's scored completions are folded in once, in training (an
        unscored one's row is NaN). Prompts are keyed by their tokens."""
        if self.history is None:
            return None
        keys = [prompt_key(ids[mask.bool()]) for ids, mask in zip(output["prompt_ids"], output["prompt_mask"])]
        keys = gather_object(keys)
        if mode != "train":
            return self.history.read(keys).to(rewards.device)
        scored = ~torch.isnan(rewards)
        prior = torch.full((rewards.numel(), 2), float("nan"), dtype=torch.float64, device=rewards.device)
        if bool(scored.any()):
            prior[scored] = self.history.update(rewards[scored], [key for key, kept in zip(keys, scored.tolist())
                                                                   if kept], all_gather=False)
        return prior

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
            old_logprobs, behaviour, advantages = cap_below_one_inputs(cap, old_logprobs, behaviour, advantages, options)
        per_token = dict(labels=completion_ids, old_logprobs=old_logprobs, response_mask=mask,
                         ref_logprobs=inputs.get("ref_per_token_logps"), advantages=advantages, **behaviour)
        if batch is not None:  # TRL's [B, T] and [B] tensors in the layout's
            per_token = {name: in_layout(batch, value) for name, value in per_token.items()}
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
            metrics["clip_frac_high"] = positive_share(inputs["advantages"], mask, sequence)
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
                # A UserWarning, which every host shows, whatever its log level.
                warnings.warn(f"resuming from {checkpoint}, which holds no {name}: it starts afresh", UserWarning,
                              stacklevel=2)
                continue
            with open(path) as handle:
                state.load_state_dict(json.load(handle))

    def _states(self) -> dict:
        """The state each checkpoint folder holds beside TRL's, by file name."""
        states = {ANCHOR_FILE: self.anchor, HISTORY_FILE: self.history}
        return {name: state for name, state in states.items() if state is not None}
