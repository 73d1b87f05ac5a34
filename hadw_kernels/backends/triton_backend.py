"""The "triton" backend: Triton kernels behind the hadw:: ops.

On CUDA the kernels are the CUDA implementation of the ops (see ``ops``), so the
dispatcher, autograd and torch.compile treat them like any ATen op. With
``TRITON_INTERPRET=1`` on CPU tensors the same kernels run in Triton's interpreter,
called directly because the CPU dispatch key belongs to the C++ backend.
"""

from __future__ import annotations

import os

import torch

from .. import ops
from ..kernels.linear_logprob import linear_logprob_backward, linear_logprob_forward
from ..kernels.surrogate import surrogate_forward

__all__ = ["surrogate_loss", "token_logprobs", "unavailable_reason"]

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

for _op, _impl in (
    ("surrogate_loss", surrogate_forward),
    ("linear_logprob_forward", linear_logprob_forward),
    ("linear_logprob_backward", linear_logprob_backward),
):
    torch.library.impl(f"{ops.LIBRARY}::{_op}", "CUDA")(_impl)


def unavailable_reason() -> str | None:
    if torch.cuda.is_available() or _INTERPRETING:
        return None
    return "no CUDA device, and TRITON_INTERPRET=1 was not set before import"


def _direct(device: torch.device) -> bool:
    return device.type != "cuda"


def surrogate_loss(logprobs, old_logprobs, rewards, response_mask, config, **tensors):
    forward_impl = surrogate_forward if _direct(logprobs.device) else None
    return ops.surrogate_loss(
        logprobs, old_logprobs, rewards, response_mask, config, forward_impl=forward_impl, **tensors
    )


def token_logprobs(hidden_states, lm_head_weight, labels, **options):
    direct = _direct(hidden_states.device)
    return ops.token_logprobs(
        hidden_states,
        lm_head_weight,
        labels,
        forward_impl=linear_logprob_forward if direct else None,
        backward_impl=linear_logprob_backward if direct else None,
        **options,
    )
