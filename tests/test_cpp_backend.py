"""The C++ CPU kernels (the "cpp" backend, csrc/) against the PyTorch reference, with the
peers' tolerance rule (tests/tolerance.py): exact = the reference on float64 copies of
the inputs, eager = the reference on the same-dtype inputs, and the kernels must be no
worse than eager. Then the op contracts (torch.library.opcheck), the loading order of
the extension and the op schemas, and the thread-count behaviour."""

import subprocess
import sys

import pytest
import torch

from hadw_kernels import LOSS_TYPES, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss
from hadw_kernels.backends import cpp_backend
from hadw_kernels.config import LossConfig
from hadw_kernels.linear_logprob import token_logprobs_reference
from hadw_kernels.surrogate import surrogate_loss as reference_surrogate
from tolerance import assert_no_worse_than_eager

if cpp_backend.unavailable_reason():
    pytest.skip(f"C++ extension not built: {cpp_backend.unavailable_reason()}", allow_module_level=True)

UPSTREAM = 0.37  # a non-unit upstream gradient: backward must scale the stored gradient
IGNORE = -100


@pytest.fixture
def threads():
    """Restores the thread count a test changes."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# --- surrogate: inputs ----------------------------------------------------------------------


def _surrogate_batch(loss_type, dtype, *, batch=12, width=13, group_size=4, kl=False, weights=None,
                     entropy=False):
    """Padding holes, an empty response (row 1), a full one (row 2), a degenerate group
    (the first: equal rewards) and a group of non-binary rewards."""
    logprobs = -torch.rand(batch, width, dtype=torch.float64) * 3
    # gspo's 3e-4 clip range needs a small drift for its sequence ratio to be unclipped.
    drift = 3e-4 if loss_type == "gspo" else 0.3
    inputs = {
        "logprobs": logprobs,
        "old_logprobs": logprobs + drift * torch.randn(batch, width, dtype=torch.float64),
        "rewards": torch.randint(0, 2, (batch,)).float(),
        "response_mask": torch.rand(batch, width) > 0.25,
    }
    inputs["response_mask"][1] = False
    inputs["response_mask"][2] = True
    inputs["rewards"][:group_size] = 1.0
    if batch >= 2 * group_size:
        inputs["rewards"][group_size:2 * group_size] = torch.rand(group_size)
    if kl:
        inputs["ref_logprobs"] = logprobs + 0.2 * torch.randn(batch, width, dtype=torch.float64)
    if weights == "token":
        inputs["importance_weights"] = torch.rand(batch, width, dtype=torch.float64) + 0.5
    elif weights == "response":
        inputs["importance_weights"] = torch.rand(batch, dtype=torch.float64) + 0.5
    if entropy:
        inputs["entropy"] = torch.rand(batch, width, dtype=torch.float64) * 2
    return {name: value.to(dtype) if value.dtype == torch.float64 else value for name, value in inputs.items()}


def _float64(inputs):
    return {name: value.double() if value.is_floating_point() else value for name, value in inputs.items()}


def _garbage_in_padding(inputs):
    """Masked positions hold inf and NaN: they must reach neither the loss nor a gradient."""
    dirty = dict(inputs)
    padding = ~inputs["response_mask"]
    for name, junk in (("logprobs", float("-inf")), ("old_logprobs", float("nan")), ("ref_logprobs", float("inf")),
                       ("importance_weights", float("inf")), ("entropy", float("nan"))):
        if name in inputs and inputs[name].dim() == 2:
            dirty[name] = inputs[name].masked_fill(padding, junk)
    return dirty


def _run_surrogate(loss_fn, inputs, config, anchor):
    """(loss, metrics, (grad logprobs, grad entropy)) of UPSTREAM * loss."""
    logprobs = inputs["logprobs"].clone().requires_grad_()
    entropy = inputs["entropy"].clone().requires_grad_() if "entropy" in inputs else None
    loss, metrics = loss_fn(
        logprobs, inputs["old_logprobs"], inputs["rewards"], inputs["response_mask"], config, anchor=anchor,
        ref_logprobs=inputs.get("ref_logprobs"), importance_weights=inputs.get("importance_weights"),
        entropy=entropy,
    )
    leaves = [logprobs] if entropy is None else [logprobs, entropy]
    # Without entropy_coef the entropy only feeds a metric: its gradient is zero.
    grads = torch.autograd.grad(loss * UPSTREAM, leaves, allow_unused=True, materialize_grads=True)
    return loss, metrics, grads


def _check_surrogate(loss_type, dtype, inputs, *, anchor=None, group_size=4, dirty_padding=False, **options):
    """Loss, gradients and every metric no worse than eager; returns the kernel's results.
    Metrics are fp32 by the op's schema, so they get fp32's slack whatever the inputs."""
    config = LossConfig.build(loss_type, group_size, **options)
    exact = _run_surrogate(reference_surrogate, _float64(inputs), config, anchor)
    eager = _run_surrogate(reference_surrogate, inputs, config, anchor)
    fast = _run_surrogate(cpp_backend.surrogate_loss, _garbage_in_padding(inputs) if dirty_padding else inputs,
                          config, anchor)
    assert_no_worse_than_eager(fast[0], eager[0], exact[0], dtype, "loss")
    for index, name in enumerate(("logprobs", "entropy")[: len(exact[2])]):
        assert fast[2][index].dtype == inputs[name].dtype
        assert_no_worse_than_eager(fast[2][index], eager[2][index], exact[2][index], dtype, f"grad_{name}")
    assert fast[1].keys() == exact[1].keys()
    for name in exact[1]:
        assert fast[1][name].dtype == torch.float32, name
        assert_no_worse_than_eager(fast[1][name], eager[1][name], exact[1][name], torch.float32, name)
    return fast


# --- surrogate: against the reference -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("anchor", [None, 0.3])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_surrogate_matches_reference(loss_type, anchor, dtype):
    _check_surrogate(loss_type, dtype, _surrogate_batch(loss_type, dtype), anchor=anchor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_dual_clip_importance_weights_and_entropy(loss_type, dtype):
    weights = "response" if loss_type == "gspo" else "token"
    inputs = _surrogate_batch(loss_type, dtype, kl=True, weights=weights, entropy=True)
    _check_surrogate(loss_type, dtype, inputs, anchor=0.6, dirty_padding=True, beta=0.05, dual_clip=1.5,
                     entropy_coef=0.01)


def test_dual_clip_binds():
    """Negative advantages with ratios far above 1 + eps: the dual-clip bound is the loss."""
    inputs = _surrogate_batch("grpo", torch.float32, batch=8, width=6)
    inputs["old_logprobs"] = inputs["logprobs"] - 2.0  # ratio e^2, above any c here
    _check_surrogate("grpo", torch.float32, inputs, anchor=0.5, dual_clip=3.0)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_per_response_weights_on_token_losses(loss_type):
    _check_surrogate(loss_type, torch.float32, _surrogate_batch(loss_type, torch.float32, weights="response"),
                     anchor=0.4)


def test_float16():
    inputs = _surrogate_batch("grpo", torch.float16, kl=True, entropy=True)
    _check_surrogate("grpo", torch.float16, inputs, anchor=0.5, beta=0.1, entropy_coef=0.02)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_float64_is_exact(loss_type):
    """fp64 accumulates in fp64. The anchor is a float64 tensor: ops.surrogate_loss turns
    a Python float into an fp32 tensor, which the reference does not round."""
    inputs = _surrogate_batch(loss_type, torch.float64, kl=True, batch=8, width=6, entropy=True)
    fast = _check_surrogate(loss_type, torch.float64, inputs, anchor=torch.tensor(0.4, dtype=torch.float64),
                            beta=0.1, entropy_coef=0.01)
    assert fast[0].dtype == torch.float64


def test_entropy_without_coefficient_has_zero_gradient():
    fast = _check_surrogate("dapo", torch.float32, _surrogate_batch("dapo", torch.float32, entropy=True))
    assert torch.equal(fast[2][1], torch.zeros_like(fast[2][1]))


@pytest.mark.parametrize("loss_type, options", [
    ("dapo", dict(loss_normalizer=200.0)),
    ("grpo", dict(loss_normalizer=40.0)),
    ("gspo", dict(loss_normalizer=40.0)),
    ("dr_grpo", dict(max_response_length=32, loss_normalizer=20.0)),
    ("dr_grpo", dict(max_response_length=20)),
])
def test_normalizer_and_max_length(loss_type, options):
    inputs = _surrogate_batch(loss_type, torch.float32, kl=True)
    _check_surrogate(loss_type, torch.float32, inputs, beta=0.02, **options)


@pytest.mark.parametrize("width", [1, 7])
@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_odd_widths_and_group_size(loss_type, width):
    inputs = _surrogate_batch(loss_type, torch.float32, batch=9, width=width, group_size=3)
    _check_surrogate(loss_type, torch.float32, inputs, anchor=0.5, group_size=3)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_gives_exact_zeros(loss_type):
    inputs = _surrogate_batch(loss_type, torch.float32, kl=True, batch=8, width=5)
    inputs["response_mask"] = torch.zeros_like(inputs["response_mask"])
    fast = _check_surrogate(loss_type, torch.float32, inputs, anchor=0.3, dirty_padding=True, beta=0.1)
    assert fast[0].item() == 0.0
    assert torch.equal(fast[2][0], torch.zeros_like(fast[2][0]))


def test_degenerate_groups_give_exact_zeros():
    inputs = _surrogate_batch("grpo", torch.float32, batch=8, width=6)
    inputs["rewards"] = torch.tensor([1.0, 1, 1, 1, 0.3, 0.3, 0.3, 0.3])
    fast = _check_surrogate("grpo", torch.float32, inputs, anchor=0.5)
    assert fast[0].item() == 0.0
    assert torch.equal(fast[2][0], torch.zeros_like(fast[2][0]))
    assert fast[1]["zero_std_frac"].item() == 1.0


def test_log_ratio_clamp_stops_the_gradient():
    """|logp - old| > 20: the ratio is exp(+-20) and the token gets no policy gradient."""
    inputs = _surrogate_batch("grpo", torch.float64, batch=4, width=5)
    inputs["old_logprobs"][0, :] = inputs["logprobs"][0, :] + 25.0
    inputs["response_mask"][0] = True
    fast = _check_surrogate("grpo", torch.float64, inputs, anchor=torch.tensor(0.5, dtype=torch.float64))
    assert torch.equal(fast[2][0][0], torch.zeros(5, dtype=torch.float64))


def test_bf16_rewards_float_mask_and_tensor_anchor():
    inputs = _surrogate_batch("dapo", torch.float32)
    inputs["rewards"] = inputs["rewards"].bfloat16()
    inputs["response_mask"] = inputs["response_mask"].float()
    _check_surrogate("dapo", torch.float32, inputs, anchor=torch.tensor(0.45))


def test_public_loss_runs_the_cpp_kernel():
    """fused_hadw_grpo_loss(backend="cpp") goes through the dispatcher to the C++ kernel."""
    inputs = _surrogate_batch("grpo", torch.float32, batch=8, width=5)
    args = (inputs["logprobs"], inputs["old_logprobs"], inputs["rewards"], inputs["response_mask"])
    loss = fused_hadw_grpo_loss(*args, group_size=4, anchor=0.5, backend="cpp")
    config = LossConfig.build("grpo", 4)
    expected, _ = reference_surrogate(*args, config, anchor=0.5)
    torch.testing.assert_close(loss, expected)
    assert torch.ops.hadw.surrogate_loss.default.has_kernel_for_dispatch_key("CPU")


def test_surrogate_does_not_depend_on_thread_count(threads):
    """Responses are summed in order, whichever thread ran them: bit-identical results."""
    inputs = _surrogate_batch("dapo", torch.float32, batch=64, width=300, kl=True, entropy=True)
    config = LossConfig.build("dapo", 4, beta=0.1, entropy_coef=0.01)
    results = []
    for count in (1, 2):
        threads(count)
        results.append(_run_surrogate(cpp_backend.surrogate_loss, inputs, config, 0.4))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))
    assert all(torch.equal(results[0][1][name], results[1][1][name]) for name in results[0][1])


def test_surrogate_gradcheck():
    inputs = _float64(_surrogate_batch("gspo", torch.float64, kl=True, batch=4, width=5, group_size=2))
    config = LossConfig.build("gspo", 2, beta=0.1)

    def loss_of(logprobs):
        return cpp_backend.surrogate_loss(logprobs, inputs["old_logprobs"], inputs["rewards"],
                                          inputs["response_mask"], config, anchor=0.4,
                                          ref_logprobs=inputs["ref_logprobs"])[0]

    assert torch.autograd.gradcheck(loss_of, (inputs["logprobs"].clone().requires_grad_(),), fast_mode=True)


# --- linear log-probs -----------------------------------------------------------------------

# (tokens, hidden, vocab, bias, temperature, logit scale). The kernels' tiles are 512
# rows x 256 vocabulary columns: 300 and 600 end on a partial tile, 2600 makes 11 tiles
# so that slabs hold several, 600 tokens make two row blocks, one token one block; a
# logit scale of 5 at temperature 0.5 puts the logits near +-40, as a trained head's.
LINEAR_CASES = [
    pytest.param(40, 32, 300, True, 0.7, 1.0, id="partial_tile-bias-temperature"),
    pytest.param(1, 24, 600, True, 1.3, 1.0, id="one_token"),
    pytest.param(600, 16, 520, False, 1.0, 1.0, id="two_row_blocks"),
    pytest.param(50, 16, 2600, False, 0.9, 1.0, id="many_tiles"),
    pytest.param(24, 16, 150, True, 0.5, 5.0, id="large_logits"),
]
LINEAR_NAMES = ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")


def _linear_case(tokens, hidden, vocab, bias, scale=1.0):
    h = torch.randn(tokens, hidden, dtype=torch.float64)
    w = torch.randn(vocab, hidden, dtype=torch.float64) * (scale / hidden**0.5)
    b = torch.randn(vocab, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, (tokens,))
    if tokens > 1:
        labels[1::7] = IGNORE
    upstream = (torch.randn(tokens, dtype=torch.float64), torch.randn(tokens, dtype=torch.float64))
    return (h, w, b), labels, upstream


def _run_linear(fn, tensors, dtype, labels, upstream, temperature, with_entropy):
    """Outputs, and the gradients of sum(g * logp + g_entropy * entropy)."""
    inputs = [None if t is None else t.to(dtype).requires_grad_() for t in tensors]
    logp, entropy = fn(inputs[0], inputs[1], labels, lm_head_bias=inputs[2], temperature=temperature,
                       ignore_index=IGNORE, with_entropy=with_entropy)
    outputs = (logp, entropy) if with_entropy else (logp,)
    total = sum((o * g.to(o.dtype)).sum() for o, g in zip(outputs, upstream))
    return (logp, entropy, *torch.autograd.grad(total, [t for t in inputs if t is not None]))


def _check_linear(tensors, labels, upstream, dtype, temperature, with_entropy=True):
    fast = _run_linear(cpp_backend.token_logprobs, tensors, dtype, labels, upstream, temperature, with_entropy)
    eager = _run_linear(token_logprobs_reference, tensors, dtype, labels, upstream, temperature, with_entropy)
    rounded = [None if t is None else t.to(dtype).double() for t in tensors]
    exact = _run_linear(token_logprobs_reference, rounded, torch.float64, labels, upstream, temperature,
                        with_entropy)
    for index, name in enumerate(LINEAR_NAMES):
        if index < len(exact) and exact[index] is not None:
            assert_no_worse_than_eager(fast[index], eager[index], exact[index], dtype, name)
    return fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden, vocab, bias, temperature, scale", LINEAR_CASES)
def test_linear_logprobs_match_reference(dtype, tokens, hidden, vocab, bias, temperature, scale):
    tensors, labels, upstream = _linear_case(tokens, hidden, vocab, bias, scale)
    logp, entropy, grad_hidden, grad_weight, *grad_bias = _check_linear(tensors, labels, upstream, dtype,
                                                                         temperature)
    assert logp.dtype == entropy.dtype == torch.float32
    assert grad_hidden.dtype == grad_weight.dtype == dtype
    ignored = labels == IGNORE
    assert torch.all(logp[ignored] == 0) and torch.all(entropy[ignored] == 0)
    assert torch.all(grad_hidden[ignored] == 0)


@pytest.mark.parametrize("tokens, hidden, vocab, bias, temperature, scale", LINEAR_CASES[:3])
def test_linear_float64_is_exact(tokens, hidden, vocab, bias, temperature, scale):
    tensors, labels, upstream = _linear_case(tokens, hidden, vocab, bias, scale)
    logp, *_ = _check_linear(tensors, labels, upstream, torch.float64, temperature)
    assert logp.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_without_entropy(dtype):
    tensors, labels, upstream = _linear_case(40, 32, 300, bias=True)
    _check_linear(tensors, labels, upstream, dtype, temperature=0.7, with_entropy=False)


def test_linear_float16():
    tensors, labels, upstream = _linear_case(40, 32, 300, bias=True)
    _check_linear(tensors, labels, upstream, torch.float16, temperature=0.7)


def _forward_op(h, w, b, labels, temperature=0.7):
    return torch.ops.hadw.linear_logprob_forward(h, w, b, labels, temperature, IGNORE, True)


def test_missing_entropy_gradient_means_zero():
    (h, w, b), labels, (upstream_logp, _) = _linear_case(40, 32, 300, bias=True)
    _, _, lse, mean_logit = _forward_op(h, w, b, labels)
    common = (h, w, b, labels, lse, mean_logit, 0.7, IGNORE)
    without = torch.ops.hadw.linear_logprob_backward(upstream_logp, None, *common)
    with_zeros = torch.ops.hadw.linear_logprob_backward(upstream_logp, torch.zeros_like(upstream_logp), *common)
    for got, expected in zip(without, with_zeros):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_all_ignored_gives_zeros_and_no_gradient():
    (h, w, _), labels, (upstream_logp, upstream_entropy) = _linear_case(20, 16, 100, bias=False)
    labels = torch.full_like(labels, IGNORE)
    logp, entropy, lse, mean_logit = _forward_op(h, w, None, labels, 1.0)
    assert torch.all(logp == 0) and torch.all(entropy == 0)
    grad_hidden, grad_weight, grad_bias = torch.ops.hadw.linear_logprob_backward(
        upstream_logp, upstream_entropy, h, w, None, labels, lse, mean_logit, 1.0, IGNORE)
    assert torch.all(grad_hidden == 0) and torch.all(grad_weight == 0)
    assert grad_bias.shape == (0,)


def test_label_outside_the_vocabulary_is_an_error():
    (h, w, b), labels, _ = _linear_case(8, 16, 100, bias=True)
    labels[3] = 100
    with pytest.raises(RuntimeError, match="outside"):
        _forward_op(h, w, b, labels)


def test_strided_hidden_gets_a_gradient_of_its_layout():
    """The fake implementation promises empty_like(hidden): the kernel keeps its strides."""
    (h, w, b), labels, (upstream_logp, _) = _linear_case(30, 16, 300, bias=True)
    strided = h.t().contiguous().t()
    _, _, lse, mean_logit = _forward_op(strided, w, b, labels)
    grad_hidden, *_ = torch.ops.hadw.linear_logprob_backward(upstream_logp, None, strided, w, b, labels, lse,
                                                             mean_logit, 0.7, IGNORE)
    expected, *_ = torch.ops.hadw.linear_logprob_backward(upstream_logp, None, h, w, b, labels, lse, mean_logit,
                                                          0.7, IGNORE)
    assert grad_hidden.stride() == strided.stride()
    torch.testing.assert_close(grad_hidden, expected, rtol=1e-12, atol=1e-12)


def test_linear_gradcheck_float64():
    h, w, b = (t.requires_grad_() for t in _linear_case(5, 6, 300, bias=True)[0])
    labels = torch.tensor([3, IGNORE, 299, 0, 256])

    def logp_and_entropy(hidden, weight, bias):
        return cpp_backend.token_logprobs(hidden, weight, labels, lm_head_bias=bias, temperature=0.8,
                                          ignore_index=IGNORE, with_entropy=True)

    assert torch.autograd.gradcheck(logp_and_entropy, (h, w, b), fast_mode=True)


def test_linear_with_one_and_two_threads(threads):
    """Thread count changes the merge order of the vocabulary slabs (rounding only);
    the same thread count gives bit-identical results."""
    (h, w, b), labels, (upstream_logp, upstream_entropy) = _linear_case(64, 32, 2600, bias=True)
    h, w, b = h.float(), w.float(), b.float()
    results = {}
    for count in (1, 2, 2):
        threads(count)
        forward = _forward_op(h, w, b, labels)
        backward = torch.ops.hadw.linear_logprob_backward(upstream_logp.float(), upstream_entropy.float(), h, w, b,
                                                          labels, forward[2], forward[3], 0.7, IGNORE)
        outputs = (*forward, *backward)
        if count in results:
            assert all(torch.equal(a, c) for a, c in zip(results[count], outputs))
        results[count] = outputs
    for one, two in zip(results[1], results[2]):
        torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6)


# --- the whole fused loss -------------------------------------------------------------------


def _loss_case(dtype, batch=8, width=7, hidden=16, vocab=300):
    h = torch.randn(batch, width, hidden).to(dtype)
    w = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, (batch, width))
    lengths = torch.randint(0, width + 1, (batch,))
    lengths[0] = width
    lengths[1] = 0  # an empty response
    mask = torch.arange(width)[None, :] < lengths[:, None]
    labels[2][~mask[2]] = IGNORE  # padding with ignore_index in one row, real tokens elsewhere
    rewards = torch.randint(0, 2, (batch,)).float()
    rewards[:4] = 1.0  # a degenerate group
    with torch.no_grad():
        exact_logp, _ = token_logprobs_reference(h.double().reshape(-1, hidden), w.double(), labels.reshape(-1))
    old = (exact_logp.view(batch, width) + 0.2 * torch.randn(batch, width, dtype=torch.float64)).float()
    return h, w, labels, old, rewards, mask


def _reference_linear_loss(h, w, labels, old, rewards, mask, config, anchor):
    batch, width, hidden = h.shape
    logp, entropy = token_logprobs_reference(h.reshape(-1, hidden), w, labels.reshape(-1), with_entropy=True)
    return reference_surrogate(logp.view(batch, width), old.to(logp.dtype), rewards.to(logp.dtype), mask, config,
                               anchor=anchor, entropy=entropy.view(batch, width))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("anchor", [None, 0.3])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fused_linear_loss_matches_full_logits_reference(loss_type, anchor, dtype):
    h, w, labels, old, rewards, mask = _loss_case(dtype)
    config = LossConfig.build(loss_type, 4, entropy_coef=0.01)
    results = {}
    for name, cast in (("exact", torch.float64), ("eager", dtype), ("fast", dtype)):
        hh, ww = h.to(cast).requires_grad_(), w.to(cast).requires_grad_()
        if name == "fast":
            loss, metrics = fused_linear_hadw_grpo_loss(
                hh, ww, labels, old, rewards, mask, group_size=4, loss_type=loss_type, anchor=anchor,
                entropy_coef=0.01, return_metrics=True, backend="cpp",
            )
        else:
            loss, metrics = _reference_linear_loss(hh, ww, labels, old, rewards, mask, config, anchor)
        results[name] = (loss, *torch.autograd.grad(loss * UPSTREAM, (hh, ww)), metrics)
    for index, name in enumerate(("loss", "grad_hidden", "grad_weight")):
        assert_no_worse_than_eager(results["fast"][index], results["eager"][index], results["exact"][index], dtype,
                                   name)
    for name, exact in results["exact"][3].items():
        assert_no_worse_than_eager(results["fast"][3][name], results["eager"][3][name], exact, torch.float32, name)
    # Padding rows get no gradient at all.
    grad_hidden = results["fast"][1]
    assert torch.equal(grad_hidden[~mask], torch.zeros_like(grad_hidden[~mask]))


# --- op contracts and loading -----------------------------------------------------------------


def _surrogate_op_args(dtype, *, optional):
    inputs = _surrogate_batch("grpo", dtype, batch=8, width=5, kl=optional, weights="token" if optional else None,
                              entropy=optional)
    inputs["logprobs"].requires_grad_()
    if optional:
        inputs["entropy"].requires_grad_()
    return (inputs["logprobs"], inputs["old_logprobs"], inputs["rewards"], inputs["response_mask"],
            torch.tensor(0.4) if optional else None, inputs.get("ref_logprobs"), inputs.get("importance_weights"),
            inputs.get("entropy"), 4, "grpo", 0.2, 0.28, 1.3, 0.1 if optional else 0.0, 2.0 if optional else None,
            0.01 if optional else 0.0, None, None)


@pytest.mark.parametrize("dtype, optional", [(torch.float32, False), (torch.float32, True),
                                             (torch.bfloat16, True), (torch.float64, True)])
def test_opcheck_surrogate(dtype, optional):
    torch.library.opcheck(torch.ops.hadw.surrogate_loss.default, _surrogate_op_args(dtype, optional=optional))


@pytest.mark.parametrize("dtype, bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_opcheck_linear_forward_and_backward(dtype, bias_dtype):
    (h, w, b), labels, (upstream_logp, upstream_entropy) = _linear_case(20, 16, 300, bias=bias_dtype is not None)
    h, w = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    b = None if b is None else b.to(bias_dtype).requires_grad_()
    torch.library.opcheck(torch.ops.hadw.linear_logprob_forward.default, (h, w, b, labels, 0.7, IGNORE, True))
    detached = [None if t is None else t.detach() for t in (h, w, b)]
    _, _, lse, mean_logit = _forward_op(*detached, labels)
    torch.library.opcheck(
        torch.ops.hadw.linear_logprob_backward.default,
        (upstream_logp.to(lse.dtype), upstream_entropy.to(lse.dtype), *detached, labels, lse, mean_logit, 0.7,
         IGNORE),
    )


def test_a_missing_extension_is_reported(monkeypatch):
    monkeypatch.setattr(cpp_backend, "EXTENSION", "hadw_kernels._not_built")
    assert "is not built" in cpp_backend._load_extension()


def test_extension_loads_before_the_op_schemas():
    """Importing the kernels before ops.py defines the schemas works too: the dispatcher
    keeps the kernels and checks them against the schemas when they arrive."""
    code = (
        "import torch\n"
        "import hadw_kernels._cpu_kernels\n"
        "from hadw_kernels import ops\n"
        "h, w = torch.randn(3, 4), torch.randn(10, 4)\n"
        "logp = torch.ops.hadw.linear_logprob_forward(h, w, None, torch.tensor([1, 2, 3]), 1.0, -100, False)[0]\n"
        "print(torch.isfinite(logp).all().item())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"

