"""The op schemas, defined once, and their fake (meta) implementations.

    hadw::surrogate_loss             the clipped surrogate from log-probs [N] in segments
                                     (cu_seqlens, hadw_kernels/batch/token_layout.py): loss, its
                                     gradient (formed in the forward), metrics, and the
                                     gradient's factor ``grad_scale``: under token-mean
                                     without a normaliser (tables.aggregations.counts_batch_tokens)
                                     a 0-d 1 / N_tok that the gradients leave out, the
                                     batch's count being formed in the launch that writes
                                     them; otherwise empty [0] (the gradients are whole)
    hadw::linear_logprob_forward     log-probs (and entropy) from hidden states and the
    hadw::linear_logprob_backward    LM head, tile by tile; backward recomputes the logits
    hadw::linear_surrogate_forward   log-probs from hidden states with the token-level
                                     surrogate's gradients formed in the same sweep

Each public op takes a trailing ``backend`` argument and is routed by the dispatcher's
device key to that backend's kernel for the tensors' device (``routing``). The C++
extension registers its CPU kernels for the same schemas in the ``hadw_cpp`` namespace,
without the ``backend`` argument (its C++ declarations are generated from the same
``signatures.SIGNATURES``). Arguments are passed by name through :func:`call`, so no
caller depends on their order.
"""

from __future__ import annotations

import torch

from ..tables.aggregations import counts_batch_tokens
from ..tables.metrics import METRIC_NAMES
from ..tables.precision import accumulate_dtype
from .signatures import OPS, SIGNATURES

LIBRARY = "hadw"
KERNEL_LIBRARY = "hadw_cpp"


def _with_backend(arguments: str) -> str:
    return arguments[:-1] + ", str backend)"


def schema(name: str, *, routed: bool) -> str:
    arguments, returns = SIGNATURES[name]
    return f"{_with_backend(arguments) if routed else arguments} -> {returns}"


_public = torch.library.Library(LIBRARY, "DEF")
_kernels = torch.library.Library(KERNEL_LIBRARY, "DEF")
for _name in OPS:
    _public.define(_name + schema(_name, routed=True))
    _kernels.define(_name + schema(_name, routed=False))


# Read once: the schemas never change, and reading one builds every argument anew. A
# plain dict of strings is also what Dynamo traces without a graph break (it cannot
# iterate a schema's arguments).
_ARGUMENT_NAMES = {
    _name: tuple(argument.name for argument in getattr(torch.ops.hadw, _name).default._schema.arguments)
    for _name in OPS
}


_TENSOR_POSITIONS = {
    _name: tuple(index for index, argument in enumerate(getattr(torch.ops.hadw, _name).default._schema.arguments)
                 if str(argument.type) in ("Tensor", "Optional[Tensor]"))
    for _name in OPS
}


def argument_names(name: str) -> tuple[str, ...]:
    return _ARGUMENT_NAMES[name]


def tensor_positions(name: str) -> tuple[int, ...]:
    """The positions of ``hadw::<name>``'s tensor arguments (a tensor or None)."""
    return _TENSOR_POSITIONS[name]


def _surrogate_fake(*arguments):
    named = dict(zip(argument_names("surrogate_loss"), arguments))
    logprobs, entropy = named["logprobs"], named["entropy"]
    accumulate = accumulate_dtype(logprobs.dtype)
    counted = counts_batch_tokens(named["loss_agg_mode"], named["loss_normalizer"])
    return (
        logprobs.new_empty((), dtype=accumulate),
        logprobs.new_empty(logprobs.shape, dtype=accumulate),
        logprobs.new_empty(entropy.shape if entropy is not None else (0,), dtype=accumulate),
        logprobs.new_empty((len(METRIC_NAMES),), dtype=torch.float32),
        logprobs.new_empty(() if counted else (0,), dtype=accumulate),
    )


def _linear_forward_fake(hidden, weight, bias, labels, *_options):
    per_row = hidden.new_empty((hidden.shape[0],), dtype=accumulate_dtype(hidden.dtype))
    return per_row, per_row.clone(), per_row.clone(), per_row.clone()


def _gradients_like(hidden, weight, bias):
    grad_bias = torch.empty_like(bias) if bias is not None else weight.new_empty((0,))
    return torch.empty_like(hidden), torch.empty_like(weight), grad_bias


def _linear_backward_fake(grad_logprobs, grad_entropy, hidden, weight, bias, *_options):
    return _gradients_like(hidden, weight, bias)


def _linear_surrogate_fake(hidden, weight, bias, labels, *_options):
    per_row = hidden.new_empty((hidden.shape[0],), dtype=accumulate_dtype(hidden.dtype))
    return (per_row, per_row.clone(), *_gradients_like(hidden, weight, bias))


_FAKES = {
    "surrogate_loss": _surrogate_fake,
    "linear_logprob_forward": _linear_forward_fake,
    "linear_logprob_backward": _linear_backward_fake,
    "linear_surrogate_forward": _linear_surrogate_fake,
}
for _library in (LIBRARY, KERNEL_LIBRARY):
    for _name, _fake in _FAKES.items():
        torch.library.register_fake(f"{_library}::{_name}")(_fake)
