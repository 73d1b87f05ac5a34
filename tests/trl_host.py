"""TRL's own loss on given tensors: ``GRPOTrainer._compute_loss`` run on a stand-in for
the trainer that carries the attributes the method reads, and hands it the test's
log-probs where it would run the model. Calling TRL's method, not a transcription of it,
keeps the host tests following TRL if TRL changes its arithmetic."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import torch
from trl import GRPOConfig, GRPOTrainer


def trl_config(loss_type: str, output_dir: str = "trl-host-test", **options) -> GRPOConfig:
    """TRL's config for ``loss_type``, with TRL's own defaults for every option not given."""
    options.setdefault("use_bias_correction_kl", False)
    return GRPOConfig(output_dir=output_dir, loss_type=loss_type, use_cpu=True, bf16=False, report_to="none",
                      per_device_train_batch_size=4, num_generations=4, **options)


class TrlLoss:
    """What ``GRPOTrainer._compute_loss`` reads of the trainer, set as GRPOTrainer.__init__
    sets it from ``args``: one process, training mode, ``accumulation`` micro-batches a step;
    vLLM's importance-sampling correction on when the inputs carry its ratio."""

    _compute_loss = GRPOTrainer._compute_loss
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask

    def __init__(self, args: GRPOConfig, accumulation: int = 1):
        self.args = args
        self.loss_type = args.loss_type
        self.beta = args.beta
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.importance_sampling_level = args.importance_sampling_level
        self.top_entropy_quantile = args.top_entropy_quantile
        self.off_policy_mask_threshold = args.off_policy_mask_threshold
        self.max_completion_length = args.max_completion_length
        self.aux_loss_enabled = False
        self._entropy_bonus_enabled = False
        self.use_vllm = False
        self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
        self.current_gradient_accumulation_steps = accumulation
        self.model = types.SimpleNamespace(training=True)
        self.accelerator = types.SimpleNamespace(num_processes=1, reduce=lambda tensor, reduction: tensor,
                                                 gather=lambda tensor: tensor,
                                                 pad_across_processes=lambda tensor, dim, pad_index: tensor)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._logprobs = None
        self._entropies = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **_):
        entropies = torch.zeros_like(self._logprobs) if self._entropies is None else self._entropies
        return self._logprobs, entropies, None

    def __call__(self, logprobs, old_logprobs, advantages, mask, *, num_items_in_batch=None, ref_logprobs=None,
                 importance_sampling_ratio=None, sampling_logprobs=None, entropies=None) -> torch.Tensor:
        """TRL's loss of one micro-batch: [B, T] tensors, advantages [B] or [B, T]; vLLM's
        log-probs (``sampling_logprobs``) and the tokens' ``entropies`` where its masks read them."""
        batch, width = mask.shape
        self._logprobs = logprobs
        self._entropies = entropies
        self.use_vllm = importance_sampling_ratio is not None
        inputs = {
            "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
            "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
            "completion_ids": torch.zeros(batch, width, dtype=torch.long),
            "completion_mask": mask.long(),
            "advantages": advantages,
            "old_per_token_logps": old_logprobs,
        }
        if num_items_in_batch is not None:
            inputs["num_items_in_batch"] = torch.tensor(float(num_items_in_batch))
        if ref_logprobs is not None:
            inputs["ref_per_token_logps"] = ref_logprobs
        if importance_sampling_ratio is not None:
            inputs["importance_sampling_ratio"] = importance_sampling_ratio
        if sampling_logprobs is not None:
            inputs["sampling_per_token_logps"] = sampling_logprobs
        return self._compute_loss(None, inputs)


def trl_importance_ratio(mode: str, old, rollout, mask, clip_min, clip_max):
    """vLLM's importance-sampling ratio as TRL 1.16's _generate_and_score_completions forms
    it (that method also generates, so it is transcribed here: docs/math.md, section 5d)."""
    difference = ((old - rollout) * mask).nan_to_num(0.0)
    ratio = torch.exp(difference.sum(-1, keepdim=True) if mode.startswith("sequence") else difference)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
