"""In-place scaling of the gradients the fused linear loss formed in its forward, by the
upstream scalar of its backward, read on the device.

``loss.backward()`` hands an upstream gradient of exactly 1, but reading it on the host
would synchronise with the GPU; eager ``mul_`` by it costs a pass over tensors the size
of the LM head (and a slow mixed-dtype kernel for a 16-bit head; measured in
docs/architecture.md, "On CUDA: cuBLAS GEMMs and two row kernels"). Here each program reads the scale and returns
at once when it is 1; otherwise it multiplies as ``mul_`` does (in fp32, fp64 for fp64
values, rounded once to the values' dtype). A NaN scale is not 1: it reaches every value.
Below SMALLEST_FOR_KERNEL values, ``mul_`` itself: a Triton launch costs more host time
than the pass it saves (measured in the same section).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import bound_kernel
from .surrogate import device_guard
from .token_math import INTERPRETING, round_to_bfloat16

__all__ = ["scale_in_place_"]

_BLOCK = 4096
SMALLEST_FOR_KERNEL = 1 << 25


@triton.jit
def _scale_kernel(values_ptr, scale_ptr, count, ROUND_BF16_BY_HAND: tl.constexpr, BLOCK: tl.constexpr):
    compute = tl.float64 if values_ptr.dtype.element_ty == tl.float64 else tl.float32
    scale = tl.load(scale_ptr).to(compute)
    if scale != 1.0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        values = tl.load(values_ptr + offsets, mask=inside)
        product = values.to(compute) * scale
        if ROUND_BF16_BY_HAND:
            product = round_to_bfloat16(product)
        tl.store(values_ptr + offsets, product.to(values.dtype), mask=inside)


def scale_in_place_(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values *= scale (a one-element tensor on values' device), in place; returns values."""
    count = values.numel()
    if count < SMALLEST_FOR_KERNEL or not values.is_contiguous():
        return values.mul_(scale)
    kernel = bound_kernel(_scale_kernel, ROUND_BF16_BY_HAND=INTERPRETING and values.dtype == torch.bfloat16,
                          BLOCK=_BLOCK, num_warps=8)
    with device_guard(values.device):
        kernel((triton.cdiv(count, _BLOCK),), values, scale.reshape(()), count)
    return values
