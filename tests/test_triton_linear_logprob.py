"""The Triton log-prob kernels (hidden states + LM head, no logits tensor) under the
interpreter: against the full-logits reference in fp64 (exact) with the eager tolerance
rule, and the whole fused loss against the "torch" backend."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("triton")

from hadw_kernels import LOSS_TYPES, fused_linear_hadw_grpo_loss  # noqa: E402
from hadw_kernels.backends import triton_backend  # noqa: E402
from hadw_kernels.kernels.linear_logprob import linear_logprob_backward, linear_logprob_forward  # noqa: E402
from hadw_kernels.linear_logprob import token_logprobs_reference  # noqa: E402
from tolerance import assert_no_worse_than_eager  # noqa: E402

IGNORE = -100
OUTPUT_NAMES = ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")

# (tokens, hidden, vocab, bias, temperature, logit scale). The interpreter's tiles are
# 16 tokens x 64 vocabulary x 16 hidden: 300 and 150 are not multiples of 64, 20 is not
# one of 16, 40 tokens give three token tiles over two vocabulary splits, 1 token gives
# one token tile over four splits; a logit scale of 5 at temperature 0.5 puts the
# logits near +-40, as a trained LM head's.
CASES = [
    pytest.param(40, 32, 300, True, 0.7, 1.0, id="ragged_vocab-bias-temperature"),
    pytest.param(40, 32, 300, False, 1.0, 1.0, id="ragged_vocab"),
    pytest.param(1, 24, 200, True, 1.3, 1.0, id="one_token"),
    pytest.param(17, 20, 128, False, 0.7, 1.0, id="ragged_hidden"),
    pytest.param(24, 16, 150, True, 0.5, 5.0, id="large_logits"),
]


def _case(tokens, hidden, vocab, bias, scale=1.0):
    h = torch.randn(tokens, hidden, dtype=torch.float64)
    w = torch.randn(vocab, hidden, dtype=torch.float64) * (scale / hidden**0.5)
    b = torch.randn(vocab, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, (tokens,))
    if tokens > 1:
        labels[1::7] = IGNORE
    upstream_logp = torch.randn(tokens, dtype=torch.float64)
    upstream_entropy = torch.randn(tokens, dtype=torch.float64)
    return (h, w, b), labels, (upstream_logp, upstream_entropy)


def _run(fn, tensors, dtype, labels, upstream, temperature, with_entropy):
    """Outputs and the grads of sum(g * logp + g_ent * entropy) wrt hidden, weight, bias."""
    inputs = [None if t is None else t.to(dtype).requires_grad_() for t in tensors]
    logp, entropy = fn(
        inputs[0], inputs[1], labels, lm_head_bias=inputs[2], temperature=temperature,
        ignore_index=IGNORE, with_entropy=with_entropy,
    )
    outputs = (logp, entropy) if with_entropy else (logp,)
    total = sum((o * g.to(o.dtype)).sum() for o, g in zip(outputs, upstream))
    grads = torch.autograd.grad(total, [t for t in inputs if t is not None])
    return (logp, entropy, *grads)


def _compare(tensors, labels, upstream, dtype, temperature, with_entropy=True):
    fast = _run(triton_backend.token_logprobs, tensors, dtype, labels, upstream, temperature, with_entropy)
    eager = _run(token_logprobs_reference, tensors, dtype, labels, upstream, temperature, with_entropy)
    # Exact: the same (rounded) inputs, in fp64.
    rounded = [None if t is None else t.to(dtype).double() for t in tensors]
    exact = _run(token_logprobs_reference, rounded, torch.float64, labels, upstream, temperature, with_entropy)
    names = [n for n in OUTPUT_NAMES if with_entropy or n != "entropy"]
    present = [i for i, value in enumerate(exact) if value is not None]
    for name, index in zip(names, present):
        assert_no_worse_than_eager(fast[index], eager[index], exact[index], dtype, name)
    return fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden, vocab, bias, temperature, scale", CASES)
def test_logprobs_entropy_and_grads_match_reference(dtype, tokens, hidden, vocab, bias, temperature, scale):
    tensors, labels, upstream = _case(tokens, hidden, vocab, bias, scale)
    logp, entropy, grad_hidden, grad_weight, *_ = _compare(tensors, labels, upstream, dtype, temperature)
    assert logp.dtype == entropy.dtype == torch.float32
    assert grad_hidden.dtype == grad_weight.dtype == dtype
    ignored = labels == IGNORE
    assert torch.all(logp[ignored] == 0) and torch.all(entropy[ignored] == 0)
    assert torch.all(grad_hidden[ignored] == 0)


def test_float64_is_exact():
    tensors, labels, upstream = _case(40, 32, 300, bias=True)
    logp, *_ = _compare(tensors, labels, upstream, torch.float64, temperature=0.7)
    assert logp.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_entropy(dtype):
    tensors, labels, upstream = _case(40, 32, 300, bias=True)
    _compare(tensors, labels, upstream, dtype, temperature=0.7, with_entropy=False)


def test_token_tile_without_upstream_gradient():
    # Rows 16-31 are the second 16-token tile: its backward programs skip the recompute.
    tensors, labels, (upstream_logp, upstream_entropy) = _case(40, 32, 300, bias=True)
    upstream_logp[16:32] = 0
    upstream_entropy[16:32] = 0
    grad_hidden = _compare(tensors, labels, (upstream_logp, upstream_entropy), torch.float32, temperature=0.7)[2]
    assert torch.all(grad_hidden[16:32] == 0)


def test_gradcheck_float64():
    h, w, b = (t.requires_grad_() for t in _case(5, 6, 70, bias=True)[0])
    labels = torch.tensor([3, IGNORE, 69, 0, 64])

    def logp_and_entropy(hidden, weight, bias):
        return triton_backend.token_logprobs(
            hidden, weight, labels, lm_head_bias=bias, temperature=0.8, ignore_index=IGNORE, with_entropy=True
        )

    assert torch.autograd.gradcheck(logp_and_entropy, (h, w, b), fast_mode=True)


def test_missing_entropy_gradient_means_zero():
    (h, w, b), labels, (upstream_logp, _) = _case(40, 32, 300, bias=True)
    _, _, lse, mean_logit = linear_logprob_forward(h, w, b, labels, 0.7, IGNORE, True)
    common = (h, w, b, labels, lse, mean_logit, 0.7, IGNORE)
    without = linear_logprob_backward(upstream_logp, None, *common)
    with_zeros = linear_logprob_backward(upstream_logp, torch.zeros_like(upstream_logp), *common)
    for got, expected in zip(without, with_zeros):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_all_ignored_gives_zeros_and_no_gradient():
    (h, w, _), labels, (upstream_logp, upstream_entropy) = _case(20, 16, 100, bias=False)
    labels = torch.full_like(labels, IGNORE)
    logp, entropy, lse, mean_logit = linear_logprob_forward(h, w, None, labels, 1.0, IGNORE, True)
    assert torch.all(logp == 0) and torch.all(entropy == 0)
    grad_hidden, grad_weight, grad_bias = linear_logprob_backward(
        upstream_logp, upstream_entropy, h, w, None, labels, lse, mean_logit, 1.0, IGNORE
    )
    assert torch.all(grad_hidden == 0) and torch.all(grad_weight == 0)
    assert grad_bias.shape == (0,)


@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_op_fake_and_reads_strided_inputs(bias):
    (h, w, b), labels, (upstream_logp, upstream_entropy) = _case(40, 16, 100, bias)
    column_major = h.float().T.contiguous().T
    weight = w.float()
    bias = None if b is None else b.float()

    def both_passes(hidden):
        logp, entropy, lse, mean_logit = linear_logprob_forward(hidden, weight, bias, labels, 0.7, IGNORE, True)
        grads = linear_logprob_backward(
            upstream_logp.float(), upstream_entropy.float(), hidden, weight, bias, labels, lse, mean_logit, 0.7,
            IGNORE,
        )
        return (logp, entropy, lse, mean_logit), grads

    outputs, grads = both_passes(column_major)
    for got, expected in zip(outputs + grads, sum(both_passes(column_major.contiguous()), ())):
        torch.testing.assert_close(got, expected)
    # What torch.compile traces on CUDA: ops.py's fake kernels must describe these outputs.
    with FakeTensorMode() as mode:
        fake = [None if t is None else mode.from_tensor(t) for t in (column_major, weight, bias, labels)]
        fake_outputs = torch.ops.hadw.linear_logprob_forward(*fake, 0.7, IGNORE, True)
        fake_grads = torch.ops.hadw.linear_logprob_backward(
            fake_outputs[0], fake_outputs[1], *fake, fake_outputs[2], fake_outputs[3], 0.7, IGNORE
        )
    for real, traced in zip(outputs + grads, tuple(fake_outputs) + tuple(fake_grads)):
        assert (real.shape, real.dtype, real.stride()) == (traced.shape, traced.dtype, traced.stride())


def _loss_case(batch=4, width=6, hidden=16, vocab=100):
    h = torch.randn(batch, width, hidden)
    w = torch.randn(vocab, hidden) / hidden**0.5
    b = torch.randn(vocab)
    labels = torch.randint(0, vocab, (batch, width))
    lengths = torch.tensor([width, 3, 0, 5])  # ragged, with one empty response
    mask = torch.arange(width)[None, :] < lengths[:, None]
    labels[2:][~mask[2:]] = IGNORE  # some padding carries ignore_index, some a real token
    old_logprobs = token_logprobs_reference(h.reshape(-1, hidden), w, labels.reshape(-1), lm_head_bias=b)[0]
    old_logprobs = (old_logprobs.view(batch, width) + 0.05 * torch.randn(batch, width)).detach()
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return h, w, b, labels, old_logprobs, rewards, mask


@pytest.mark.parametrize("anchor", [None, 0.3])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fused_loss_matches_torch_backend(loss_type, anchor):
    h, w, b, labels, old_logprobs, rewards, mask = _loss_case()
    results = {}
    for backend in ("torch", "triton"):
        inputs = [t.clone().requires_grad_() for t in (h, w, b)]
        loss, metrics = fused_linear_hadw_grpo_loss(
            inputs[0], inputs[1], labels, old_logprobs, rewards, mask, group_size=2, loss_type=loss_type,
            anchor=anchor, lm_head_bias=inputs[2], temperature=0.9, entropy_coef=0.01, return_metrics=True,
            backend=backend,
        )
        results[backend] = (loss, *torch.autograd.grad(loss, inputs), metrics)
    torch_loss, *torch_grads, torch_metrics = results["torch"]
    triton_loss, *triton_grads, triton_metrics = results["triton"]
    torch.testing.assert_close(triton_loss, torch_loss)
    for name, got, expected in zip(("grad_hidden", "grad_weight", "grad_bias"), triton_grads, torch_grads):
        torch.testing.assert_close(got, expected, msg=lambda text, name=name: f"{name}: {text}")
    assert triton_metrics.keys() == torch_metrics.keys()
    for name in torch_metrics:
        torch.testing.assert_close(triton_metrics[name], torch_metrics[name], msg=lambda text, name=name: f"{name}: {text}")
