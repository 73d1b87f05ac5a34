"""The peers' tolerance rule: a fast path's error against an fp64 reference must be no
worse than the same-dtype eager PyTorch error, plus a small tolerance."""

from __future__ import annotations

import torch

# Slack on top of eager's own error, by dtype: (absolute, relative to |exact|).
SLACK = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-3, 2e-3),
    torch.float16: (5e-4, 5e-4),
}


def assert_no_worse_than_eager(fast, eager, exact, dtype, name="value"):
    """Elementwise: |fast - exact| <= |eager - exact| + atol + rtol * |exact|."""
    assert fast is not None and exact is not None, f"{name}: missing tensor"
    fast, eager, exact = (t.detach().double() for t in (fast, eager, exact))
    assert fast.shape == exact.shape, f"{name}: shape {tuple(fast.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(fast).all(), f"{name}: fast path is not finite"
    atol, rtol = SLACK[dtype]
    fast_error = (fast - exact).abs()
    bound = (eager - exact).abs() + atol + rtol * exact.abs()
    worst = (fast_error - bound).argmax() if fast_error.numel() else None
    assert (fast_error <= bound).all(), (
        f"{name}: fast error {fast_error.flatten()[worst]:.3e} exceeds eager error + slack "
        f"{bound.flatten()[worst]:.3e} at flat index {worst} (max fast error {fast_error.max():.3e})"
    )
