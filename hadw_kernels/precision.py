"""The dtype the library computes in: every reduction, log-softmax, advantage and loss
runs in at least fp32, whatever the inputs' dtype (fp64 inputs stay fp64)."""

from __future__ import annotations

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)
