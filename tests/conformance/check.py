"""The one check of the suite: the peers' tolerance rule (tests/tolerance.py) on every
value, every gradient and every metric of a backend's run; and one surrogate case run in
either layout against the padded reference (:func:`compare`)."""

from __future__ import annotations

import torch
from cases import (
    Outputs,
    cast,
    loss_kwargs,
    pack,
    rounded,
    run_surrogate,
    run_surrogate_packed,
    surrogate_batch,
)
from tolerance import assert_no_worse_than_eager

from hadw_kernels.config.presets import LOSS_PRESETS
from hadw_kernels.tables.aggregations import AGGREGATIONS


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


# --- one surrogate case, in either layout ------------------------------------------------------

WIDTH = 37


def drift(loss_type: str) -> float:
    """The behaviour policy's distance: GSPO's clip range is 3e-4 wide, so a small drift
    keeps some sequence ratios inside it."""
    return 1e-3 if loss_type == "gspo" else 0.3


def with_length(kwargs: dict, width: int) -> dict:
    """A packed batch has no width: an aggregation that divides by a constant L gets the
    padded batch's (for both layouts, so the two compare)."""
    mode = kwargs.get("loss_agg_mode", LOSS_PRESETS[kwargs["loss_type"]].loss_agg_mode)
    if AGGREGATIONS[mode].times_max_length and kwargs.get("max_response_length") is None:
        kwargs = dict(kwargs, max_response_length=width)
    return kwargs


def compare_padded(backend, device, loss_type, variant, dtype, *, seed=0, width=WIDTH) -> Outputs:
    """The public loss from log-probs on a padded batch: ``backend`` against same-dtype
    eager PyTorch (the torch backend) and the exact fp64 reference."""
    batch = surrogate_batch(seed, width=width, drift=drift(loss_type))
    kwargs = loss_kwargs(batch, loss_type, variant)
    logprobs, mask = batch["logprobs"], batch["response_mask"]
    on_device = cast(kwargs, dtype, device)
    fast = run_surrogate(backend, logprobs.to(dtype).to(device), mask.to(device), on_device)
    eager = run_surrogate("torch", logprobs.to(dtype).to(device), mask.to(device), on_device)
    exact = run_surrogate("torch", logprobs.to(dtype).double(), mask, rounded(kwargs, dtype))
    assert_conforms(fast, eager, exact, dtype)
    # Padding and empty responses get exactly zero gradient, whatever they held.
    assert torch.all(fast.values["grad_logprobs"][~mask.to(device)] == 0)
    return fast


def compare_packed(backend, device, loss_type, variant, dtype, *, seed=0, batch=None, empty_segments="prompt_only",
                   per_token_shape=lambda t: t) -> Outputs:
    """The same responses packed into segments (cases.pack) on ``backend``, against the
    padded batch's eager and exact runs: packed equals padded, on loss, gradient and
    metrics."""
    batch = batch or surrogate_batch(seed, width=WIDTH, drift=drift(loss_type))
    shape = tuple(batch["response_mask"].shape)
    packed = pack(batch, seed, empty_segments=empty_segments)
    padded_kwargs = with_length(loss_kwargs(batch, loss_type, variant), shape[1])
    packed_kwargs = with_length(loss_kwargs(packed.tensors, loss_type, variant), shape[1])
    logprobs, mask = packed.tensors["logprobs"], packed.tensors["response_mask"]
    per_token = ("old_logprobs", "ref_logprobs", "importance_weights", "advantages", "rollout_logprobs", "entropy")
    packed_kwargs = {key: per_token_shape(value) if key in per_token and value.shape == logprobs.shape else value
                     for key, value in packed_kwargs.items()}
    fast = run_surrogate_packed(backend, packed, per_token_shape(logprobs).to(dtype).to(device),
                                per_token_shape(mask).to(device), cast(packed_kwargs, dtype, device))
    grad = fast.values["grad_logprobs"].reshape(-1)
    # Prompt tokens and empty responses get exactly zero gradient, whatever they held.
    assert torch.all(grad[~mask.to(device)] == 0)
    fast = Outputs({"loss": fast.values["loss"], "grad_logprobs": packed.unpack(grad, shape)}, fast.metrics)
    padded_logprobs, padded_mask = batch["logprobs"], batch["response_mask"]
    eager = run_surrogate("torch", padded_logprobs.to(dtype).to(device), padded_mask.to(device),
                          cast(padded_kwargs, dtype, device))
    exact = run_surrogate("torch", padded_logprobs.to(dtype).double(), padded_mask, rounded(padded_kwargs, dtype))
    assert_conforms(fast, eager, exact, dtype)
    return fast


def compare(backend, device, loss_type, variant, dtype, layout, **options) -> Outputs:
    return (compare_packed if layout == "packed" else compare_padded)(backend, device, loss_type, variant, dtype,
                                                                      **options)
