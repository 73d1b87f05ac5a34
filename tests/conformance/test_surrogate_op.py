"""hadw::surrogate_loss on every backend against the reference: every loss type (each
an objective and its ratio form) and option variant, four dtypes and both layouts, as
every pair of those axes (cases.pairwise_cases), with poisoned padding, degenerate
groups, empty and full responses, an odd width and a non-unit upstream gradient."""

import pytest
import torch
from cases import (
    DTYPES,
    LAYOUTS,
    OBJECTIVE_VARIANT_OPTIONS,
    SURROGATE_VARIANTS,
    Variant,
    cast,
    loss_kwargs,
    pairwise_cases,
    rounded,
    run_surrogate_op_with_entropy,
    surrogate_batch,
    with_required,
)
from check import assert_conforms, compare, compare_padded, drift

from hadw_kernels import LOSS_TYPES, fused_hadw_grpo_loss
from hadw_kernels.config.presets import LOSS_PRESETS
from hadw_kernels.objectives.table import OBJECTIVES

PAIRWISE = pairwise_cases()


def test_the_cases_cover_every_pair():
    axes = (LOSS_TYPES, [str(v) for v in SURROGATE_VARIANTS], DTYPES, LAYOUTS)
    seen = [(loss_type, str(variant), dtype, layout) for loss_type, variant, dtype, layout in PAIRWISE]
    for first in range(4):
        for second in range(first + 1, 4):
            pairs = {(case[first], case[second]) for case in seen}
            assert len(pairs) == len(axes[first]) * len(axes[second]), (first, second)


def test_every_objective_runs_in_the_cases():
    """Every row of the table runs here: through a loss type that presets it, or its own
    variant (cases.unpreset_objective_variants); each has options away from its defaults."""
    assert set(OBJECTIVE_VARIANT_OPTIONS) == set(OBJECTIVES)
    run = {LOSS_PRESETS[loss_type].objective for loss_type in LOSS_TYPES}
    run |= {variant.options["objective"] for variant in SURROGATE_VARIANTS if "objective" in variant.options}
    assert run == set(OBJECTIVES)


@pytest.mark.parametrize("loss_type, variant, dtype, layout", PAIRWISE,
                         ids=[f"{l}-{v}-{str(d)[6:]}-{layout}" for l, v, d, layout in PAIRWISE])
def test_matches_reference(backend, device, loss_type, variant, dtype, layout):
    compare(backend, device, loss_type, variant, dtype, layout)


@pytest.mark.parametrize("width", [1, 7])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_odd_widths(backend, device, loss_type, width):
    compare_padded(backend, device, loss_type, Variant("hadw", {"anchor": 0.4}), torch.float32, seed=width,
                   width=width)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_input(backend, device, loss_type, dtype):
    """The op's entropy input (what the linear loss feeds it): its gradient is
    -entropy_coef times the aggregation weight, and entropy_mean joins the metrics."""
    batch = surrogate_batch(3, drift=drift(loss_type))
    variant = Variant("hadw_kl", {"anchor": 0.35, "beta": 0.05}, ("old_logprobs", "rewards", "ref_logprobs"))
    kwargs = loss_kwargs(batch, loss_type, variant)
    logprobs, entropy, mask = batch["logprobs"], batch["entropy"], batch["response_mask"]
    runs = {}
    for name, run_backend, on, cast_dtype in (("fast", backend, device, dtype), ("eager", "torch", device, dtype),
                                              ("exact", "reference", torch.device("cpu"), torch.float64)):
        inputs = cast(kwargs, cast_dtype, on) if name != "exact" else rounded(kwargs, dtype)
        runs[name] = run_surrogate_op_with_entropy(
            run_backend, logprobs.to(dtype).to(cast_dtype).to(on), entropy.to(dtype).to(cast_dtype).to(on),
            mask.to(on), inputs, entropy_coef=0.01,
        )
    assert_conforms(runs["fast"], runs["eager"], runs["exact"], dtype)


def test_a_retained_graph_gives_the_same_gradient_again(backend, device):
    """The gradient formed in the forward is scaled into a new tensor by each backward:
    differentiating the graph twice (retain_graph) gives it twice, unchanged."""
    batch = surrogate_batch(5)
    kwargs = cast(loss_kwargs(batch, "grpo", Variant("hadw", {"anchor": 0.4})), torch.float32, device)
    logprobs = batch["logprobs"].float().to(device).requires_grad_()
    loss = fused_hadw_grpo_loss(logprobs, response_mask=batch["response_mask"].to(device), backend=backend, **with_required(kwargs))
    (first,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
    (second,) = torch.autograd.grad(loss * 2, logprobs)
    torch.testing.assert_close(second, 2 * first, rtol=0, atol=0)
