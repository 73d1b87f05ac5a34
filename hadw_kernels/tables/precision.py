"""The dtype the library computes in: every reduction, log-softmax, advantage and loss
runs in at least fp32, whatever the inputs' dtype (fp64 inputs stay fp64)."""

from __future__ import annotations

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (of the floating types: the library takes no other).
    Not ``torch.promote_types``, which is a dispatched operator: a small call's host time
    is counted in operators (docs/benchmarks.md, "Host time of a small call")."""
    return torch.float64 if dtype == torch.float64 else torch.float32
