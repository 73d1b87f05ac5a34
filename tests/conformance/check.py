"""The one check of the suite: the peers' tolerance rule (tests/tolerance.py) on every
value, every gradient and every metric of a backend's run."""

from __future__ import annotations

import torch

from cases import Outputs
from tolerance import assert_no_worse_than_eager


def assert_conforms(fast: Outputs, eager: Outputs, exact: Outputs, dtype: torch.dtype) -> None:
    """Same outputs and metrics as the reference; each no worse than same-dtype eager
    PyTorch against the exact (fp64) result, plus the dtype's slack. Where the exact
    result is NaN (a NaN input), the fast one must be NaN too."""
    assert set(fast.values) == set(exact.values), (sorted(fast.values), sorted(exact.values))
    assert list(fast.metrics) == list(exact.metrics), (list(fast.metrics), list(exact.metrics))
    # Metrics are fp32 by contract, whatever the inputs' dtype.
    metric_dtype = torch.float32 if dtype == torch.float64 else dtype
    named = [(name, dtype, fast.values[name], eager.values[name], exact.values[name]) for name in exact.values]
    named += [(name, metric_dtype, fast.metrics[name], eager.metrics[name], exact.metrics[name])
              for name in exact.metrics]
    for name, slack_dtype, fast_value, eager_value, exact_value in named:
        fast_value, eager_value, exact_value = (t.detach().cpu().double() for t in (fast_value, eager_value, exact_value))
        nan = torch.isnan(exact_value)
        assert torch.equal(torch.isnan(fast_value), nan), f"{name}: NaN where the reference has none, or the reverse"
        assert_no_worse_than_eager(fast_value[~nan], eager_value[~nan], exact_value[~nan], slack_dtype, name)
