"""The public losses: check the inputs, pick a backend, run it."""

from __future__ import annotations

import torch

from .backends import resolve_backend
from .config import DEFAULT_LAMBDA_SCALE, LossConfig
from .linear_logprob import IGNORE_INDEX
from .validation import check_label_range, check_linear_inputs, check_surrogate_inputs

Metrics = dict[str, torch.Tensor]


def fused_hadw_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int,
    loss_type: str = "grpo",
    anchor: float | torch.Tensor | None = None,
    lambda_scale: float = DEFAULT_LAMBDA_SCALE,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
    loss_normalizer: float | None = None,
    max_response_length: int | None = None,
    return_metrics: bool = False,
    backend: str = "auto",
    check_values: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, Metrics]:
    """The group-relative clipped surrogate with HA-DW, from per-token log-probs.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the current policy.
        old_logprobs: [B, T] the same under the behaviour policy.
        rewards: [B], each group's ``group_size`` responses contiguous.
        response_mask: [B, T], 1 on response tokens, 0 on padding (bool or 0/1).
        group_size: G, responses per prompt.
        loss_type: "grpo", "dapo", "gspo" or "dr_grpo" (SPEC section 5).
        anchor: the difficulty belief C (a float or 0-d tensor, e.g. from
            ``DifficultyAnchor.update``); None runs the plain algorithm without HA-DW.
        lambda_scale: Phi's scale (paper: 1.3; the authors' code: 1.5).
        epsilon_low, epsilon_high: clip range; default by loss type.
        beta, ref_logprobs: KL(k3) to a reference policy, aggregated like the loss.
        dual_clip: c > 1 bounding the loss of negative advantages, or None.
        importance_weights: detached rollout-engine correction, [B, T] or [B]
            (gspo: [B]).
        loss_normalizer: the batch denominator (valid tokens for dapo, responses for
            the others) for gradient accumulation: pass the whole rollout batch's count
            to every micro-batch and their losses add up to the big-batch loss.
        max_response_length: Dr.GRPO's constant L_max (default: T).
        return_metrics: also return a dict of 0-d tensors (clip fractions, mean ratio,
            approximate KL, mean Phi, zero-variance group fraction).
        backend: "auto", "torch", "triton" or "cpp".
        check_values: check rewards are finite and the mask is 0/1 (one host sync on
            CUDA).
    """
    config = LossConfig.build(
        loss_type,
        group_size,
        epsilon_low,
        epsilon_high,
        lambda_scale=lambda_scale,
        beta=beta,
        dual_clip=dual_clip,
        loss_normalizer=loss_normalizer,
        max_response_length=max_response_length,
    )
    check_surrogate_inputs(
        logprobs,
        old_logprobs,
        rewards,
        response_mask,
        config,
        anchor=anchor,
        ref_logprobs=ref_logprobs,
        importance_weights=importance_weights,
        check_values=check_values,
    )
    implementation = resolve_backend(backend, logprobs.device)
    loss, metrics = implementation.surrogate_loss(
        logprobs,
        old_logprobs,
        rewards,
        response_mask,
        config,
        anchor=anchor,
        ref_logprobs=ref_logprobs,
        importance_weights=importance_weights,
        entropy=None,
    )
    return (loss, metrics) if return_metrics else loss


def fused_linear_hadw_grpo_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int,
    loss_type: str = "grpo",
    anchor: float | torch.Tensor | None = None,
    lambda_scale: float = DEFAULT_LAMBDA_SCALE,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    entropy_coef: float = 0.0,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
    loss_normalizer: float | None = None,
    max_response_length: int | None = None,
    return_metrics: bool = False,
    backend: str = "auto",
    check_values: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, Metrics]:
    """The same loss from hidden states [B, T, H] and the LM head [V, H].

    ``labels`` [B, T] are the sampled tokens (already shifted: hidden state t predicts
    label t). The log-probs of the labels are formed tile by tile, never as [B*T, V]
    logits. ``entropy_coef`` subtracts the aggregated entropy of the token distribution
    (an exploration bonus). Other arguments as in :func:`fused_hadw_grpo_loss`. Under
    DeepSpeed ZeRO-3 pass the gathered LM head (``GatheredParameters``), see README.
    """
    config = LossConfig.build(
        loss_type,
        group_size,
        epsilon_low,
        epsilon_high,
        lambda_scale=lambda_scale,
        beta=beta,
        dual_clip=dual_clip,
        entropy_coef=entropy_coef,
        loss_normalizer=loss_normalizer,
        max_response_length=max_response_length,
    )
    check_linear_inputs(hidden_states, lm_head_weight, labels, lm_head_bias, temperature)
    batch, width, _ = hidden_states.shape
    # The surrogate checks see a stand-in for the log-probs: same shape, device, dtype.
    logprobs_shape = hidden_states.new_empty(batch, width)
    check_surrogate_inputs(
        logprobs_shape,
        old_logprobs,
        rewards,
        response_mask,
        config,
        anchor=anchor,
        ref_logprobs=ref_logprobs,
        importance_weights=importance_weights,
        check_values=check_values,
    )
    if check_values:
        check_label_range(labels, lm_head_weight.shape[0], ignore_index)
    implementation = resolve_backend(backend, hidden_states.device)
    with_entropy = entropy_coef > 0 or return_metrics
    # Padding is masked out of the loss anyway; as ignored labels its rows skip the GEMMs
    # in the kernels that skip ignored rows.
    logprobs, entropy = _batched_token_logprobs(
        implementation,
        hidden_states,
        lm_head_weight,
        labels.masked_fill(~response_mask.bool(), ignore_index),
        lm_head_bias=lm_head_bias,
        temperature=temperature,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
    )
    loss, metrics = implementation.surrogate_loss(
        logprobs,
        old_logprobs,
        rewards,
        response_mask,
        config,
        anchor=anchor,
        ref_logprobs=ref_logprobs,
        importance_weights=importance_weights,
        entropy=entropy,
    )
    return (loss, metrics) if return_metrics else loss


def token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
    backend: str = "auto",
    check_values: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] of ``labels`` under softmax(h W^T / temperature), without the
    logits: e.g. the old policy's log-probs before an update. Differentiable; returns
    ``(logprobs, entropy)`` with ``with_entropy=True``. Ignored labels give 0."""
    check_linear_inputs(hidden_states, lm_head_weight, labels, lm_head_bias, temperature)
    if check_values:
        check_label_range(labels, lm_head_weight.shape[0], ignore_index)
    logprobs, entropy = _batched_token_logprobs(
        resolve_backend(backend, hidden_states.device),
        hidden_states,
        lm_head_weight,
        labels,
        lm_head_bias=lm_head_bias,
        temperature=temperature,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
    )
    return (logprobs, entropy) if with_entropy else logprobs


def _batched_token_logprobs(implementation, hidden_states, lm_head_weight, labels, **options):
    """The backend's token_logprobs on [B, T, H] flattened to rows, reshaped to [B, T]."""
    batch, width, hidden_size = hidden_states.shape
    logprobs, entropy = implementation.token_logprobs(
        hidden_states.reshape(batch * width, hidden_size), lm_head_weight, labels.reshape(-1), **options
    )
    return logprobs.view(batch, width), None if entropy is None else entropy.view(batch, width)
