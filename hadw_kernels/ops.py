"""One op schema for the fused ops; each device plugs its kernels into it.

    hadw::surrogate_loss          CPU: csrc (C++)   CUDA: Triton
    hadw::linear_logprob_forward  CPU: csrc (C++)   CUDA: Triton
    hadw::linear_logprob_backward CPU: csrc (C++)   CUDA: Triton

The schemas, fake (meta) implementations and autograd formulas live here, once, so
the C++ library only registers kernels (``TORCH_LIBRARY_IMPL``) and the same calls run
inside ``torch.compile`` graphs. ``backend="auto"`` is then the dispatcher's choice.

The surrogate op returns the loss together with its gradient with respect to the
log-probs (and the entropy): the loss is the end of the graph, so backward only scales
the stored gradient by the upstream scalar.

Under the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``) the CPU dispatch key
belongs to C++, so the Triton forward functions are called directly through
:class:`_DirectSurrogate` / :class:`_DirectLinearLogprob`, which apply the same
backward formulas.
"""

from __future__ import annotations

from typing import Callable

import torch

from .config import LossConfig

LIBRARY = "hadw"

# Order of the metrics vector every surrogate kernel writes.
METRIC_NAMES = (
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "approx_kl",
    "phi_mean",
    "zero_std_frac",
    "ref_kl",
    "entropy_mean",
)

SURROGATE_SCHEMA = (
    "(Tensor logprobs, Tensor old_logprobs, Tensor rewards, Tensor response_mask, "
    "Tensor? anchor, Tensor? ref_logprobs, Tensor? importance_weights, Tensor? entropy, "
    "int group_size, str loss_type, float epsilon_low, float epsilon_high, "
    "float lambda_scale, float beta, float? dual_clip, float entropy_coef, "
    "float? loss_normalizer, int? max_response_length) "
    "-> (Tensor loss, Tensor grad_logprobs, Tensor grad_entropy, Tensor metrics)"
)
LINEAR_FORWARD_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, float temperature, "
    "int ignore_index, bool with_entropy) "
    "-> (Tensor logprobs, Tensor entropy, Tensor lse, Tensor mean_logit)"
)
LINEAR_BACKWARD_SCHEMA = (
    "(Tensor grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
    "Tensor? bias, Tensor labels, Tensor lse, Tensor mean_logit, float temperature, "
    "int ignore_index) -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)"
)

_library = torch.library.Library(LIBRARY, "DEF")
_library.define("surrogate_loss" + SURROGATE_SCHEMA)
_library.define("linear_logprob_forward" + LINEAR_FORWARD_SCHEMA)
_library.define("linear_logprob_backward" + LINEAR_BACKWARD_SCHEMA)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@torch.library.register_fake(f"{LIBRARY}::surrogate_loss")
def _surrogate_fake(logprobs, old_logprobs, rewards, response_mask, anchor, ref_logprobs,
                    importance_weights, entropy, *args):
    accumulate = _accumulate_dtype(logprobs.dtype)
    grad_entropy = logprobs.new_empty(entropy.shape if entropy is not None else (0,), dtype=accumulate)
    return (
        logprobs.new_empty((), dtype=accumulate),
        logprobs.new_empty(logprobs.shape, dtype=accumulate),
        grad_entropy,
        logprobs.new_empty((len(METRIC_NAMES),), dtype=torch.float32),
    )


@torch.library.register_fake(f"{LIBRARY}::linear_logprob_forward")
def _linear_forward_fake(hidden, weight, bias, labels, temperature, ignore_index, with_entropy):
    accumulate = _accumulate_dtype(hidden.dtype)
    rows = hidden.shape[0]
    per_row = hidden.new_empty((rows,), dtype=accumulate)
    return per_row, per_row.clone(), per_row.clone(), per_row.clone()


@torch.library.register_fake(f"{LIBRARY}::linear_logprob_backward")
def _linear_backward_fake(grad_logprobs, grad_entropy, hidden, weight, bias, labels, lse,
                          mean_logit, temperature, ignore_index):
    grad_bias = bias.new_empty(bias.shape) if bias is not None else weight.new_empty((0,))
    return torch.empty_like(hidden), torch.empty_like(weight), grad_bias


# --- autograd -------------------------------------------------------------------------


def _surrogate_setup(ctx, inputs, output):
    ctx.logprobs_dtype = inputs[0].dtype
    ctx.entropy_dtype = None if inputs[7] is None else inputs[7].dtype
    ctx.save_for_backward(output[1], output[2])


def _scaled(stored_grad: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_loss * stored_grad written straight into ``dtype``: one kernel, no fp32 temp."""
    return torch.mul(stored_grad, grad_loss, out=torch.empty_like(stored_grad, dtype=dtype))


def _surrogate_backward(ctx, grad_loss, *_unused):
    grad_logprobs, grad_entropy = ctx.saved_tensors
    grads = [None] * 18
    grads[0] = _scaled(grad_logprobs, grad_loss, ctx.logprobs_dtype)
    if ctx.entropy_dtype is not None:
        grads[7] = _scaled(grad_entropy, grad_loss, ctx.entropy_dtype)
    return tuple(grads)


torch.library.register_autograd(
    f"{LIBRARY}::surrogate_loss", _surrogate_backward, setup_context=_surrogate_setup
)


def _linear_setup(ctx, inputs, output):
    hidden, weight, bias, labels, temperature, ignore_index, _ = inputs
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.has_bias = bias is not None
    ctx.with_entropy = inputs[6]
    ctx.save_for_backward(hidden, weight, bias, labels, output[2], output[3])


def _linear_backward(ctx, grad_logprobs, grad_entropy, *_unused):
    hidden, weight, bias, labels, lse, mean_logit = ctx.saved_tensors
    # Autograd hands zeros for an entropy nobody asked for: skip its term instead.
    grad_entropy = grad_entropy if ctx.with_entropy else None
    grad_hidden, grad_weight, grad_bias = torch.ops.hadw.linear_logprob_backward(
        grad_logprobs, grad_entropy, hidden, weight, bias, labels, lse, mean_logit,
        ctx.temperature, ctx.ignore_index,
    )
    return grad_hidden, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


torch.library.register_autograd(
    f"{LIBRARY}::linear_logprob_forward", _linear_backward, setup_context=_linear_setup
)


# --- direct calls (kernels outside the dispatcher: the Triton interpreter) --------------


class _DirectSurrogate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_impl, logprobs, entropy, *args):
        loss, grad_logprobs, grad_entropy, metrics = forward_impl(logprobs, *args[:6], entropy, *args[6:])
        ctx.logprobs_dtype = logprobs.dtype
        ctx.entropy_dtype = None if entropy is None else entropy.dtype
        ctx.save_for_backward(grad_logprobs, grad_entropy)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        grad_logprobs, grad_entropy = ctx.saved_tensors
        grad_entropy_out = None
        if ctx.entropy_dtype is not None:
            grad_entropy_out = _scaled(grad_entropy, grad_loss, ctx.entropy_dtype)
        return (None, _scaled(grad_logprobs, grad_loss, ctx.logprobs_dtype), grad_entropy_out) + (None,) * 16


class _DirectLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_impl, backward_impl, hidden, weight, bias, labels, temperature, ignore_index,
                with_entropy):
        logprobs, entropy, lse, mean_logit = forward_impl(
            hidden, weight, bias, labels, temperature, ignore_index, with_entropy
        )
        ctx.backward_impl = backward_impl
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        ctx.has_bias = bias is not None
        ctx.with_entropy = with_entropy
        ctx.save_for_backward(hidden, weight, bias, labels, lse, mean_logit)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, lse, mean_logit = ctx.saved_tensors
        grad_entropy = grad_entropy if ctx.with_entropy else None
        grad_hidden, grad_weight, grad_bias = ctx.backward_impl(
            grad_logprobs, grad_entropy, hidden, weight, bias, labels, lse, mean_logit,
            ctx.temperature, ctx.ignore_index,
        )
        return None, None, grad_hidden, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


# --- the calls the backends make -------------------------------------------------------


def surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: LossConfig,
    *,
    anchor=None,
    ref_logprobs=None,
    importance_weights=None,
    entropy=None,
    forward_impl: Callable | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Runs the surrogate op (or ``forward_impl`` directly) and names the metrics."""
    if anchor is not None and not isinstance(anchor, torch.Tensor):
        # torch.full, not torch.tensor: no blocking host-to-device copy on CUDA.
        # float64: a Python float is double, and fp32 would round it for fp64 inputs.
        anchor = torch.full((), float(anchor), dtype=torch.float64, device=logprobs.device)
    scalars = (
        config.group_size, config.loss_type, config.epsilon_low, config.epsilon_high,
        config.lambda_scale, config.beta, config.dual_clip, config.entropy_coef,
        None if config.loss_normalizer is None else float(config.loss_normalizer),
        config.max_response_length,
    )
    if forward_impl is None:
        loss, _, _, metrics = torch.ops.hadw.surrogate_loss(
            logprobs, old_logprobs, rewards, response_mask, anchor, ref_logprobs,
            importance_weights, entropy, *scalars,
        )
    else:
        loss, metrics = _DirectSurrogate.apply(
            forward_impl, logprobs, entropy, old_logprobs, rewards, response_mask, anchor,
            ref_logprobs, importance_weights, *scalars,
        )
    named = dict(zip(METRIC_NAMES, metrics.detach().unbind()))
    if config.beta <= 0:
        del named["ref_kl"]
    if entropy is None:
        del named["entropy_mean"]
    return loss, named


def token_logprobs(
    hidden_states, lm_head_weight, labels, *, lm_head_bias, temperature, ignore_index, with_entropy,
    forward_impl: Callable | None = None, backward_impl: Callable | None = None,
):
    """Runs the linear log-prob op (or the given implementations directly)."""
    if forward_impl is None:
        logprobs, entropy, _, _ = torch.ops.hadw.linear_logprob_forward(
            hidden_states, lm_head_weight, lm_head_bias, labels, float(temperature), ignore_index, with_entropy
        )
    else:
        logprobs, entropy = _DirectLinearLogprob.apply(
            forward_impl, backward_impl, hidden_states, lm_head_weight, lm_head_bias, labels,
            float(temperature), ignore_index, with_entropy,
        )
    return logprobs, entropy if with_entropy else None
