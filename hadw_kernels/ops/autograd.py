"""The autograd formula of ``linear_logprob_forward``, and how the losses whose gradients
are formed in the forward hand them to autograd.

``linear_logprob_forward``'s backward is the ``linear_logprob_backward`` op of the same
backend, which recomputes the logits. ``surrogate_loss`` and ``linear_surrogate_forward``
return their gradients as outputs and have no formula: the loss is the end of the graph,
so the loss attaches them (``attach_gradients``) and backward only scales them by the
upstream scalar. An op formula would cost the call more: torch.library's autograd
wrapper refills the schema's defaults on every call, quadratic in its ~25 arguments
(measured in docs/benchmarks.md, "The C++ kernels while they were built").
"""

from __future__ import annotations

import torch

from ..checks.arguments import detached
from .routing import call
from .schemas import LIBRARY, argument_names


def _scaled(stored_grad: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_loss * stored_grad written straight into ``dtype``: one kernel, no fp32 temp."""
    if stored_grad.dtype == dtype:
        return stored_grad * grad_loss  # (a 0-d factor keeps the gradient's dtype)
    return torch.mul(stored_grad, grad_loss, out=torch.empty_like(stored_grad, dtype=dtype))


_LINEAR_ARGUMENTS = argument_names("linear_logprob_forward")


def _linear_setup(ctx, inputs, output):
    named = dict(zip(_LINEAR_ARGUMENTS, inputs))
    ctx.options = {key: named[key] for key in ("temperature", "ignore_index", "backend")}
    ctx.has_bias = named["bias"] is not None
    ctx.with_entropy = named["with_entropy"]
    ctx.save_for_backward(named["hidden"], named["weight"], named["bias"], named["labels"], output[2], output[3])


def _linear_backward(ctx, grad_logprobs, grad_entropy, *_unused):
    hidden, weight, bias, labels, lse, mean_logit = ctx.saved_tensors
    grad_hidden, grad_weight, grad_bias = call(
        "linear_logprob_backward",
        grad_logprobs=grad_logprobs,
        # Autograd hands zeros for an entropy nobody asked for: skip its term instead.
        grad_entropy=grad_entropy if ctx.with_entropy else None,
        hidden=hidden, weight=weight, bias=bias, labels=labels, lse=lse, mean_logit=mean_logit,
        **ctx.options,
    )
    grads = dict(hidden=grad_hidden, weight=grad_weight, bias=grad_bias if ctx.has_bias else None)
    return tuple(grads.get(name) for name in _LINEAR_ARGUMENTS)


torch.library.register_autograd(
    f"{LIBRARY}::linear_logprob_forward", _linear_backward, setup_context=_linear_setup
)


def _multiply_in_place(gradient: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    return gradient.mul_(grad_loss)


class _AttachGradients(torch.autograd.Function):
    # The inputs and their gradients come as one flat argument list (inputs first):
    # Dynamo traces tensors passed one by one, not a tuple of them.
    @staticmethod
    def forward(ctx, loss, scale_in_place, grad_scale, *inputs_and_gradients):
        count = len(inputs_and_gradients) // 2
        ctx.gradients = inputs_and_gradients[count:]
        ctx.scale_in_place = scale_in_place
        ctx.grad_scale = grad_scale
        ctx.dtypes = [tensor.dtype for tensor in inputs_and_gradients[:count]]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.gradients is None:
            raise RuntimeError(
                "the fused linear loss's gradients were already handed to a backward; "
                "compute the loss again for another one"
            )
        if ctx.grad_scale is not None:  # a factor the gradients left out (ops/schemas.py)
            grad_loss = grad_loss * ctx.grad_scale
        if ctx.scale_in_place is None:  # kept (attach_gradients): scaled into new tensors
            scaled = [_scaled(gradient, grad_loss, dtype) for gradient, dtype in zip(ctx.gradients, ctx.dtypes)]
            return (None, None, None, *scaled, *[None] * len(scaled))
        # The stored gradients belong to this graph alone: scale them in place rather
        # than copying tensors the size of the LM head (docs/benchmarks.md, "The C++ kernels while they were built"). The
        # usual upstream gradient is exactly 1 (``loss.backward()``): on the CPU, where
        # reading it costs no device synchronisation, that pass over them is skipped; a
        # backend's own ``scale_in_place`` may skip it on its device (triton/scale.py).
        # (Not under torch.compile, which cannot branch on a value: docs/architecture.md.)
        unit = (
            not torch.compiler.is_compiling() and grad_loss.device.type == "cpu" and grad_loss.numel() == 1
            and grad_loss.item() == 1.0
        )
        scaled = []
        for gradient, dtype in zip(ctx.gradients, ctx.dtypes):
            if gradient.dtype == dtype and unit:
                scaled.append(gradient)
            elif gradient.dtype == dtype:
                scaled.append(ctx.scale_in_place(gradient, grad_loss))
            else:
                scaled.append(_scaled(gradient, grad_loss, dtype))
        ctx.gradients = None
        return (None, None, None, *scaled, *[None] * len(scaled))


def attach_gradients(loss: torch.Tensor, inputs, gradients, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``loss`` as a function of ``inputs`` whose gradients were formed in the forward:
    its backward returns ``gradients`` times the upstream scalar (and ``grad_scale``, a
    0-d factor they left out), as new tensors in the inputs' dtypes, as often as the graph
    is differentiated (``retain_graph``). An input given as None (an optional one) has none."""
    return _apply(detached(loss), None, grad_scale, inputs, gradients)


def attach_single_use_gradients(loss: torch.Tensor, inputs, gradients, scale_in_place=None) -> torch.Tensor:
    """The same for gradients too large to copy (the LM head's): one backward scales them
    in place with ``scale_in_place(gradient, grad_loss)`` (default: ``mul_``) and hands
    them over; a second backward of the graph is refused."""
    return _apply(detached(loss), scale_in_place or _multiply_in_place, None, inputs, gradients)


# Function.apply without its generic argument handling (a binding of every argument and
# an unwrap of each tensor, a third of its cost), where nothing needs it: no torch.compile
# (Dynamo traces Function.apply itself) and no functorch transform; the caller's inputs are
# unwrapped as Function.apply would, should a finished transform have left them wrapped.
_apply_function = super(torch.autograd.Function, _AttachGradients).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_transforms_active = torch._C._are_functorch_transforms_active


def _apply(loss, scale_in_place, grad_scale, inputs, gradients) -> torch.Tensor:
    """_AttachGradients of the inputs that are given, then their gradients: one argument
    list (Dynamo traces tensors passed one by one, and each argument costs the call)."""
    pairs = [(tensor, gradient) for tensor, gradient in zip(inputs, gradients) if tensor is not None]
    if torch.compiler.is_compiling() or _transforms_active():
        return _AttachGradients.apply(loss, scale_in_place, grad_scale, *[tensor for tensor, _ in pairs],
                                      *[gradient for _, gradient in pairs])
    return _apply_function(loss, scale_in_place, grad_scale, *[_unwrap_if_dead(tensor) for tensor, _ in pairs],
                           *[gradient for _, gradient in pairs])
