"""The packed (padding-free) layout on every backend: the same responses packed into
segments (each led by a masked prompt that holds NaN and inf) give the padded batch's
loss, every gradient and every metric, against the padded reference (docs/options.md,
"Packed batches").

The main matrix (test_surrogate_op.py) runs both layouts among its pairs; here are the
packed layout's own edges: empty segments of no token, the model's [1, N] form, a segment
longer than any block beside one-token ones, S = 1, N = 0, int32 offsets, and the linear
loss.
"""

from __future__ import annotations

import pytest
import torch
from cases import (
    BLOCK_ROWS,
    GROUP_SIZE,
    UPSTREAM,
    Variant,
    cast,
    linear_batch,
    loss_kwargs,
    pack,
    reference_linear_loss,
    rounded,
    run_linear_loss,
    surrogate_batch,
    with_required,
)
from check import WIDTH, assert_conforms, compare_packed, drift, with_length

from hadw_kernels import LOSS_TYPES, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss
from hadw_kernels.backends import load_backend


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_length_segments(backend, device, loss_type):
    """Empty responses as segments of no token at all (two of them, the first at the
    start of the batch), rather than of a prompt alone."""
    batch = surrogate_batch(2, width=WIDTH, drift=drift(loss_type))
    batch["response_mask"][0] = False
    compare_packed(backend, device, loss_type, Variant("hadw", {"anchor": 0.35}), torch.float32, seed=2,
                    batch=batch, empty_segments="zero_length")


@pytest.mark.parametrize("form", ["[1, N]", "mixed"])
def test_model_output_shape(backend, device, form):
    """Per-token tensors as a packed model gives them, [1, N], alone or mixed with [N]."""
    def shape(tensor):
        return tensor[None] if form == "[1, N]" or tensor.dtype == torch.bool else tensor

    compare_packed(backend, device, "grpo", Variant("hadw_kl", {"anchor": 0.35, "beta": 0.05},
                                                     ("old_logprobs", "rewards", "ref_logprobs",
                                                      "token_importance_weights")),
                    torch.float32, per_token_shape=shape)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_long_and_one_token_segments(backend, device, loss_type):
    """A segment longer than any block (the Triton tile follows the mean segment length;
    the C++ chunk is 256 tokens) beside segments of one token."""
    batch = surrogate_batch(4, batch=8, width=3000, drift=drift(loss_type))
    lengths = torch.tensor([3000, 1, 1, 2, 1, 0, 1, 5])
    batch["response_mask"] = torch.arange(3000)[None, :] < lengths[:, None]
    compare_packed(backend, device, loss_type, Variant("hadw_dual_clip", {"anchor": 0.5, "dual_clip": 3.0}),
                    torch.float32, seed=4, batch=batch)


def test_one_segment(backend, device):
    """S = 1 (advantages given: one response makes no group)."""
    batch = surrogate_batch(5, batch=1, width=WIDTH)
    compare_packed(backend, device, "dapo", Variant("advantages", {}, ("old_logprobs", "advantages")),
                    torch.float32, seed=5, batch=batch)


@pytest.mark.parametrize("segments", [0, 4])
def test_no_tokens(backend, device, segments):
    """N = 0: no segment, or only empty ones. The loss is exactly 0; with rewards, the
    groups' metrics are still the groups'."""
    logprobs = torch.zeros(0, device=device, requires_grad=True)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0][:segments], device=device)
    kwargs = dict(group_size=GROUP_SIZE, anchor=0.3) if segments else dict(advantages=torch.zeros(0, device=device))
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, None, rewards if segments else None, torch.zeros(0, dtype=torch.bool, device=device),
        cu_seqlens=torch.zeros(segments + 1, dtype=torch.int64, device=device), return_metrics=True,
        backend=backend, **kwargs,
    )
    loss.backward()
    assert loss.item() == 0 and logprobs.grad.shape == (0,)
    padded, padded_metrics = fused_hadw_grpo_loss(
        torch.zeros(segments, 0, device=device), None, rewards if segments else None,
        torch.zeros(segments, 0, dtype=torch.bool, device=device), return_metrics=True, backend="torch", **kwargs,
    )
    assert list(metrics) == list(padded_metrics)
    for name in metrics:
        torch.testing.assert_close(metrics[name], padded_metrics[name], msg=name)


def test_int32_offsets(backend, device):
    """flash-attention's offsets are int32."""
    batch = surrogate_batch(6, width=WIDTH)
    packed = pack(batch, 6)
    kwargs = cast(loss_kwargs(packed.tensors, "grpo", Variant("hadw", {"anchor": 0.3})), torch.float32, device)
    logprobs, mask = packed.tensors["logprobs"].float().to(device), packed.tensors["response_mask"].to(device)
    results = [
        fused_hadw_grpo_loss(logprobs, response_mask=mask, cu_seqlens=packed.cu_seqlens.to(dtype).to(device),
                             backend=backend, **with_required(kwargs))
        for dtype in (torch.int32, torch.int64)
    ]
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["gspo", "luspo"])
def test_long_segments_are_summed_as_accurately_as_padded_rows(backend, device, loss_type):
    """Two responses of 100,000 float32 tokens each, whose per-response sums (GSPO's mean
    log-ratio, LUSPO's length-scaled loss) add up a long segment: the packed loss is no
    further from the float64 value than the padded loss of the same backend (a sequential
    float32 sum over the segment was 20x further)."""
    length = 100_000
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(2 * length, generator=generator) * 2 - 1
    old = logprobs + 0.01 * torch.randn(2 * length, generator=generator)
    mask = torch.ones(2 * length, dtype=torch.bool)
    options = dict(advantages=torch.tensor([1.0, 0.5], device=device), loss_type=loss_type)
    exact = fused_hadw_grpo_loss(logprobs.double(), old.double(), None, mask, cu_seqlens=torch.tensor([0, length, 2 * length]),
                                 backend="torch", max_response_length=length,
                                 **dict(options, advantages=options["advantages"].cpu().double()))
    logprobs, old, mask = logprobs.to(device), old.to(device), mask.to(device)
    packed = fused_hadw_grpo_loss(logprobs, old, None, mask, cu_seqlens=torch.tensor([0, length, 2 * length], device=device),
                                  backend=backend, max_response_length=length, **options)
    padded = fused_hadw_grpo_loss(logprobs.view(2, length), old.view(2, length), None, mask.view(2, length),
                                  backend=backend, **options)
    packed_error, padded_error = (abs(float(value) - float(exact)) for value in (packed, padded))
    assert packed_error <= 2 * padded_error + 1e-7 * abs(float(exact)), (packed_error, padded_error)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, options", [("luspo", {}), ("gmpo", {}), ("grpo", {"ratio_level": "sequence"})],
                         ids=["luspo", "gmpo", "grpo-sequence"])
def test_long_segments_backward_is_as_accurate_as_padded_rows(backend, device, loss_type, options):
    """The backward of long segments (two of 200,000 float32 tokens), for the objectives
    whose every token's gradient goes through its response's ratio, whose gradient sums
    the segment's tokens.
    The packed gradient is no further from the float64 one (relative to its largest
    element) than the padded gradient of the same backend (a float32 sum over the segment
    in the expansion's backward was 3,000x further)."""
    length = 200_000
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(2 * length, generator=generator) * 2 - 1
    old = logprobs + 0.01 * torch.randn(2 * length, generator=generator)
    rewards, mask = torch.tensor([1.0, 0.0]), torch.ones(2 * length, dtype=torch.bool)
    offsets = torch.tensor([0, length, 2 * length])
    options = dict(options, group_size=2, anchor=0.3, loss_type=loss_type, max_response_length=length)

    def gradient(values, shape, dtype, on, backend, **layout):
        values = values.to(dtype).to(on).view(shape).requires_grad_()
        fused_hadw_grpo_loss(values, old.to(dtype).to(on).view(shape), rewards.to(dtype).to(on),
                             mask.to(on).view(shape), backend=backend, **layout, **options).backward()
        return values.grad.reshape(-1).cpu().double()

    exact = gradient(logprobs, (2 * length,), torch.float64, "cpu", "torch", cu_seqlens=offsets)
    packed = gradient(logprobs, (2 * length,), torch.float32, device, backend, cu_seqlens=offsets.to(device))
    padded = gradient(logprobs, (2, length), torch.float32, device, backend)
    scale = float(exact.abs().max())
    packed_error, padded_error = (float((value - exact).abs().max()) / scale for value in (packed, padded))
    assert packed_error <= 2 * padded_error + 1e-7, (packed_error, padded_error)


# --- the linear loss -------------------------------------------------------------------------

LINEAR_CASES = [
    # (loss type, variant, dtype, path): every loss type, dtype and path, each variant.
    ("grpo", Variant("hadw_kl_entropy_bias_temperature", {"anchor": 0.35, "beta": 0.05, "entropy_coef": 0.01,
                                                          "temperature": 0.7, "dual_clip": 3.0},
                     ("old_logprobs", "rewards", "ref_logprobs", "bias")), torch.float32, "gradients_in_forward"),
    ("dapo", Variant("importance_weights_normalizer", {"loss_normalizer": 40.0, "kl_estimator": "k2", "beta": 0.02},
                     ("old_logprobs", "rewards", "token_importance_weights", "ref_logprobs")), torch.bfloat16,
     "recompute"),
    ("gspo", Variant("response_importance_weights", {"anchor": 0.6},
                     ("old_logprobs", "rewards", "response_importance_weights")), torch.float64, "recompute"),
    ("dr_grpo", Variant("advantages_on_policy", {"entropy_coef": 0.02}, ("advantages",)), torch.float16,
     "gradients_in_forward"),
]


@pytest.mark.parametrize("check_values", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("loss_type, variant, dtype, path", LINEAR_CASES, ids=lambda value: str(value)[:40])
def test_linear_packed_matches_padded(backend, device, loss_type, variant, dtype, path, check_values):
    """Hidden states [N, H] of a packed batch (prompt rows hold NaN and labels outside
    the vocabulary), blocks of 8 rows ending inside segments. Checked (the default call),
    the prompt rows are left out of the sweep on every backend; unchecked, the triton
    and torch backends sweep them too, zeroed."""
    if path == "gradients_in_forward" and not load_backend(backend).has_gradients_in_forward(device):
        pytest.skip(f"backend {backend!r} has no gradients-in-forward path")
    data = linear_batch(11)
    shape = tuple(data["response_mask"].shape)
    vocab = data["lm_head_weight"].shape[0]
    packed = pack(data, 11)
    taken = packed.padded_index >= 0
    hidden = torch.full((packed.padded_index.numel(), data["hidden_states"].shape[-1]), float("nan"),
                        dtype=torch.float64)
    hidden[taken] = data["hidden_states"].reshape(-1, hidden.shape[-1])[packed.padded_index[taken]]
    labels = torch.full((packed.padded_index.numel(),), vocab + 3, dtype=torch.int64)
    labels[taken] = data["labels"].reshape(-1)[packed.padded_index[taken]]
    tensors = tuple(name for name in variant.tensors if name != "bias")
    bias = data["lm_head_bias"] if "bias" in variant.tensors else None
    plain = Variant(variant.name, variant.options, tensors)
    padded_kwargs = with_length(loss_kwargs(data, loss_type, plain), shape[1])
    packed_kwargs = with_length(loss_kwargs(packed.tensors, loss_type, plain), shape[1])

    def convert(tensor, on, in_dtype):
        return None if tensor is None else tensor.to(dtype).to(in_dtype).to(on)

    weight = data["lm_head_weight"]
    fast = run_linear_loss(
        backend, convert(hidden, device, dtype), convert(weight, device, dtype), labels.to(device),
        packed.tensors["response_mask"].to(device), cast(packed_kwargs, dtype, device),
        lm_head_bias=convert(bias, device, dtype), linear_path=path, cu_seqlens=packed.cu_seqlens.to(device),
        check_values=check_values,
    )
    grad_hidden = fast.values["grad_hidden"]
    assert torch.all(grad_hidden[~packed.tensors["response_mask"].to(device)] == 0)
    unpacked = torch.zeros(shape[0] * shape[1], grad_hidden.shape[-1], dtype=grad_hidden.dtype, device=device)
    unpacked[packed.padded_index[taken].to(device)] = grad_hidden[taken.to(device)]
    fast.values["grad_hidden"] = unpacked.view(*shape, -1)
    mask = data["response_mask"]
    eager = reference_linear_loss(
        convert(data["hidden_states"], device, dtype), convert(weight, device, dtype), data["labels"].to(device),
        mask.to(device), cast(padded_kwargs, dtype, device), lm_head_bias=convert(bias, device, dtype),
    )
    exact = reference_linear_loss(data["hidden_states"].to(dtype).double(), weight.to(dtype).double(),
                                  data["labels"], mask, rounded(padded_kwargs, dtype),
                                  lm_head_bias=None if bias is None else bias.to(dtype).double())
    assert_conforms(fast, eager, exact, dtype)


def test_linear_model_output_shape(backend, device):
    """[1, N, H] hidden states and [1, N] labels and mask, as a packed model gives them,
    equal the [N, H] form."""
    data = linear_batch(3)
    packed = pack(data, 3)
    taken = packed.padded_index >= 0
    hidden = torch.zeros(packed.padded_index.numel(), data["hidden_states"].shape[-1], dtype=torch.float32)
    hidden[taken] = data["hidden_states"].reshape(-1, hidden.shape[-1])[packed.padded_index[taken]].float()
    labels = torch.zeros(packed.padded_index.numel(), dtype=torch.int64)
    labels[taken] = data["labels"].reshape(-1)[packed.padded_index[taken]]
    weight = data["lm_head_weight"].float().to(device)
    mask = packed.tensors["response_mask"]
    kwargs = dict(advantages=data["advantages"].float().to(device), cu_seqlens=packed.cu_seqlens.to(device))
    losses = []
    for batch_dim in (False, True):
        def shaped(tensor, batch_dim=batch_dim):
            return (tensor[None] if batch_dim else tensor).to(device)
        leaf = shaped(hidden).detach().clone().requires_grad_()
        loss = fused_linear_hadw_grpo_loss(leaf, weight, shaped(labels), None, None, shaped(mask), backend=backend,
                                           block_rows=BLOCK_ROWS, **kwargs)
        (loss * UPSTREAM).backward()
        assert leaf.grad.shape == leaf.shape
        losses.append((loss.detach(), leaf.grad.reshape(-1)))
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
