"""The "triton" backend: Triton kernels behind the hadw:: ops.

On CUDA tensors the kernels are compiled. On CPU tensors they run in Triton's
interpreter when ``TRITON_INTERPRET=1`` was set before this module was imported (the
test suite's way to run them without a GPU); otherwise the backend does not serve CPU
tensors and says so. Either way the calls go through the same ops, gradient handling
and routing as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import ops
from ..triton.linear_logprob import linear_logprob_backward, linear_logprob_forward, linear_surrogate_forward
from ..triton.scale import scale_in_place_
from ..triton.surrogate import surrogate_forward
from ..triton.token_math import INTERPRETING
from .kernel_backend import KernelBackend

NAME = "triton"

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    "surrogate_loss": surrogate_forward,
    "linear_logprob_forward": linear_logprob_forward,
    "linear_logprob_backward": linear_logprob_backward,
    "linear_surrogate_forward": linear_surrogate_forward,
}

_devices = []
if INTERPRETING:
    _devices.append("cpu")
else:
    ops.set_unavailable_reason(
        NAME, "cpu", "its kernels run on CUDA; on CPU tensors they need Triton's interpreter "
        "(set TRITON_INTERPRET=1 before importing hadw_kernels)"
    )
if torch.cuda.is_available() and not INTERPRETING:
    _devices.append("cuda")
else:
    ops.set_unavailable_reason(
        NAME, "cuda", "Triton's interpreter is on (TRITON_INTERPRET=1)" if INTERPRETING else "no CUDA device"
    )
for _device in _devices:
    for _op, _implementation in _IMPLEMENTATIONS.items():
        ops.register_kernel(_op, NAME, _device, _implementation)

BACKEND = KernelBackend(NAME, scale_in_place=scale_in_place_)
