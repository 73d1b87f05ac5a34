"""The op schemas, defined once, and their fake (meta) implementations.

    hadw::surrogate_loss             the clipped surrogate from log-probs: loss, its
                                     gradient (formed in the forward), metrics
    hadw::linear_logprob_forward     log-probs (and entropy) from hidden states and the
    hadw::linear_logprob_backward    LM head, tile by tile; backward recomputes the logits
    hadw::linear_surrogate_forward   log-probs from hidden states with the token-level
                                     surrogate's gradients formed in the same sweep

Each public op takes a trailing ``backend`` argument and is routed by the dispatcher's
device key to that backend's kernel for the tensors' device (``routing``). The C++
extension registers its CPU kernels for the same schemas in the ``hadw_cpp`` namespace,
without the ``backend`` argument. Arguments are passed by name through
:func:`call`, so no caller depends on their order.
"""

from __future__ import annotations

import torch

from ..config import METRIC_NAMES
from ..precision import accumulate_dtype

LIBRARY = "hadw"
KERNEL_LIBRARY = "hadw_cpp"

_PER_TOKEN_OPTIONS = (
    "float epsilon_low, float epsilon_high, float? dual_clip, float beta, int kl_estimator, float entropy_coef"
)
SIGNATURES = {
    "surrogate_loss": (
        "(Tensor logprobs, Tensor old_logprobs, Tensor response_mask, Tensor? rewards, Tensor? advantages, "
        "Tensor? anchor, Tensor? ref_logprobs, Tensor? importance_weights, Tensor? entropy, int? group_size, "
        "bool normalize_std, float std_eps, float lambda_scale, int loss_agg_mode, bool sequence_level, "
        f"{_PER_TOKEN_OPTIONS}, float? loss_normalizer, int? max_response_length)",
        "(Tensor loss, Tensor grad_logprobs, Tensor grad_entropy, Tensor metrics)",
    ),
    "linear_logprob_forward": (
        "(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, float temperature, int ignore_index, "
        "bool with_entropy)",
        "(Tensor logprobs, Tensor entropy, Tensor lse, Tensor mean_logit)",
    ),
    "linear_logprob_backward": (
        "(Tensor grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
        "Tensor lse, Tensor mean_logit, float temperature, int ignore_index)",
        "(Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)",
    ),
    "linear_surrogate_forward": (
        "(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor? old_logprobs, Tensor advantages, "
        "Tensor agg_weights, Tensor? ref_logprobs, Tensor? importance_weights, float temperature, "
        f"int ignore_index, {_PER_TOKEN_OPTIONS}, bool with_entropy, int block_rows)",
        "(Tensor logprobs, Tensor entropy, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)",
    ),
}
OPS = tuple(SIGNATURES)


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


def argument_names(name: str) -> tuple[str, ...]:
    return _ARGUMENT_NAMES[name]


def call(name: str, **arguments):
    """Calls ``hadw::<name>`` with its arguments given by name (all of them)."""
    names = argument_names(name)
    missing = set(names) - set(arguments)
    unknown = set(arguments) - set(names)
    if missing or unknown:
        raise TypeError(f"hadw::{name}: missing arguments {sorted(missing)}, unknown {sorted(unknown)}")
    return getattr(torch.ops.hadw, name)(*(arguments[key] for key in names))


def _surrogate_fake(logprobs, old_logprobs, response_mask, rewards, advantages, anchor, ref_logprobs,
                    importance_weights, entropy, *_options):
    accumulate = accumulate_dtype(logprobs.dtype)
    return (
        logprobs.new_empty((), dtype=accumulate),
        logprobs.new_empty(logprobs.shape, dtype=accumulate),
        logprobs.new_empty(entropy.shape if entropy is not None else (0,), dtype=accumulate),
        logprobs.new_empty((len(METRIC_NAMES),), dtype=torch.float32),
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
