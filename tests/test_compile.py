"""torch.compile(fullgraph=True) through both losses and the module forms on the CPU,
for the torch and cpp backends and the triton one under Triton's interpreter
(docs/architecture.md, "torch.compile"): no graph break, the eager loss, gradients and
metrics, and a batch size that changes without a recompile storm.

Compiling is slow on a small machine, so the cases are few and small, and most use the
"aot_eager" backend: it runs Dynamo, the fake (meta) kernels and AOTAutograd, where
graph breaks and missing fakes show; one case runs Inductor end to end."""

import pytest
import torch

from hadw_kernels import (
    HADWGRPOLoss,
    LinearHADWGRPOLoss,
    available_backends,
    fused_hadw_grpo_loss,
    fused_linear_hadw_grpo_loss,
)

torch._dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

WIDTH, HIDDEN, VOCAB = 6, 8, 16
OPTIONS = dict(group_size=2, anchor=0.4, return_metrics=True)


def _needs(backend):
    return [] if backend in available_backends("cpu") else [pytest.mark.skip(reason=f"no {backend} backend here")]


def _batch(loss, batch):
    """(leaves that get gradients, the other tensors) of a call with ``batch`` rows."""
    mask = torch.ones(batch, WIDTH)
    mask[:, -2:] = 0
    mask[0, 1] = 0
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0] * (batch // 4))
    if loss == "surrogate":
        logprobs = -torch.rand(batch, WIDTH)
        return [logprobs], [logprobs - 0.1 * torch.rand(batch, WIDTH), rewards, mask]
    hidden = torch.randn(batch, WIDTH, HIDDEN)
    hidden[1, -1] = float("nan")  # padding: reaches no output and no gradient
    leaves = [hidden, torch.randn(VOCAB, HIDDEN)]
    return leaves, [torch.randint(0, VOCAB, (batch, WIDTH)), -torch.rand(batch, WIDTH) - 2, rewards, mask]


def _callable(loss, form, backend):
    if form == "module":
        # The anchor is a per-call argument of the modules, the rest held options.
        held = {key: value for key, value in OPTIONS.items() if key != "anchor"}
        module = (HADWGRPOLoss if loss == "surrogate" else LinearHADWGRPOLoss)(backend=backend, **held)
        return lambda *tensors: module(*tensors, anchor=OPTIONS["anchor"])
    function = fused_hadw_grpo_loss if loss == "surrogate" else fused_linear_hadw_grpo_loss
    return lambda *tensors: function(*tensors, backend=backend, **OPTIONS)


def _run(fn, leaves, others, dynamic_batch=False):
    leaves = [leaf.clone().requires_grad_() for leaf in leaves]
    if dynamic_batch:  # every tensor's first dimension is the batch, but the LM head's
        for tensor in [leaves[0], *others]:
            torch._dynamo.mark_dynamic(tensor, 0)
    value, metrics = fn(*leaves, *others)
    value.backward()
    return value.detach(), [leaf.grad for leaf in leaves], metrics


def _assert_same(compiled, eager):
    torch.testing.assert_close(compiled[0], eager[0])
    for got, expected in zip(compiled[1], eager[1]):
        torch.testing.assert_close(got, expected)
    assert compiled[2].keys() == eager[2].keys()
    for name, expected in eager[2].items():
        torch.testing.assert_close(compiled[2][name], expected, msg=name)


# One compile per case: each loss on each backend, the module forms on one of them each.
CASES = [
    pytest.param("surrogate", "function", "torch", "aot_eager", id="surrogate-torch"),
    pytest.param("surrogate", "module", "cpp", "inductor", marks=_needs("cpp"), id="surrogate-module-cpp-inductor"),
    pytest.param("surrogate", "function", "triton", "aot_eager", marks=_needs("triton"), id="surrogate-triton"),
    pytest.param("linear", "module", "torch", "aot_eager", id="linear-module-torch"),
    pytest.param("linear", "function", "cpp", "aot_eager", marks=_needs("cpp"), id="linear-cpp"),
    pytest.param("linear", "function", "triton", "aot_eager", marks=_needs("triton"), id="linear-triton"),
]


@pytest.mark.parametrize("loss, form, backend, compiler", CASES)
def test_compiled_matches_eager(loss, form, backend, compiler):
    """fullgraph=True raises at any graph break. Eager runs the value checks, the
    compiled call skips them (loss._checks_run)."""
    torch._dynamo.reset()
    fn = _callable(loss, form, backend)
    leaves, others = _batch(loss, 4)
    eager = _run(fn, leaves, others)
    compiled = _run(torch.compile(fn, fullgraph=True, backend=compiler), leaves, others)
    _assert_same(compiled, eager)


@pytest.mark.parametrize("loss, backend", [
    pytest.param("surrogate", "torch", id="surrogate-torch"),
    pytest.param("surrogate", "cpp", marks=_needs("cpp"), id="surrogate-cpp"),
    pytest.param("linear", "cpp", marks=_needs("cpp"), id="linear-cpp"),
    pytest.param("surrogate", "triton", marks=_needs("triton"), id="surrogate-triton"),
    pytest.param("linear", "triton", marks=_needs("triton"), id="linear-triton"),
])
def test_packed_compiled_matches_eager(loss, backend):
    """A packed batch ([N] tokens, cu_seqlens) compiles without a graph break: the
    offsets' check is an asynchronous assert there, the segments' sums traceable ops."""
    torch._dynamo.reset()
    leaves, others = _batch(loss, 4)
    mask = others[-1].bool()
    cu_seqlens = torch.arange(5) * WIDTH
    # The batch's rows as four segments of WIDTH tokens, per-token tensors [N] ([N, H]).
    packed_leaves = [leaves[0].reshape(-1, *leaves[0].shape[2:]), *leaves[1:]]
    packed_others = [t.reshape(-1) if t.shape[:2] == mask.shape else t for t in others]
    function = fused_hadw_grpo_loss if loss == "surrogate" else fused_linear_hadw_grpo_loss

    def fn(*tensors):
        return function(*tensors, cu_seqlens=cu_seqlens, backend=backend, **OPTIONS)

    eager = _run(fn, packed_leaves, packed_others)
    compiled = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), packed_leaves, packed_others)
    _assert_same(compiled, eager)
    padded = _run(_callable(loss, "function", backend), leaves, others)
    torch.testing.assert_close(eager[0], padded[0])


@pytest.mark.parametrize("backend", [pytest.param(name, marks=_needs(name)) for name in ("cpp", "triton")])
@pytest.mark.parametrize("loss", ["surrogate", "linear"])
def test_token_mean_compiles(loss, backend):
    """token-mean (dapo): the kernels leave its 1 / N_tok to the op's grad_scale, which
    backward applies (ops/schemas.py): one graph, eager's loss and gradients."""
    torch._dynamo.reset()
    function = fused_hadw_grpo_loss if loss == "surrogate" else fused_linear_hadw_grpo_loss

    def fn(*tensors):
        return function(*tensors, backend=backend, loss_type="dapo", check_values=False, **OPTIONS)

    leaves, others = _batch(loss, 4)
    _assert_same(_run(torch.compile(fn, fullgraph=True, backend="aot_eager"), leaves, others),
                 _run(fn, leaves, others))


@pytest.mark.slow
@pytest.mark.parametrize("loss, backend", [
    pytest.param("surrogate", "cpp", marks=_needs("cpp"), id="surrogate-cpp"),
    pytest.param("linear", "torch", id="linear-torch"),
])
def test_batch_size_changes_without_recompiling(loss, backend):
    """Marked dynamic, a second and a third batch size reuse the first graph; unmarked,
    Dynamo's automatic dynamic shapes recompile once, at the second size, and never
    again."""
    fn = _callable(loss, "function", backend)
    for marked, frames in ((True, 1), (False, 2)):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        for batch in (4, 8, 12):
            leaves, others = _batch(loss, batch)
            _assert_same(_run(compiled, leaves, others, dynamic_batch=marked), _run(fn, leaves, others))
        assert counter.frame_count == frames, (marked, counter.frame_count)


@pytest.mark.skipif("cpp" not in available_backends("cpu"), reason="no cpp backend here")
@pytest.mark.parametrize("with_optional", [False, True], ids=["bare", "entropy-bias-kl"])
def test_fake_kernels_match_the_cpp_ops(with_optional):
    """Every output of every hadw:: op has a fake of the real kernel's shape, dtype and
    strides, also with symbolic shapes (torch.library.opcheck)."""
    from hadw_kernels.config.loss_config import LossConfig
    from hadw_kernels.ops import argument_names

    def check(op, **arguments):
        values = tuple(arguments[name] for name in argument_names(op))
        torch.library.opcheck(getattr(torch.ops.hadw, op).default, values,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

    config = LossConfig.build("grpo", 2, beta=0.04 if with_optional else 0.0, entropy_coef=0.01)
    rows = 4 * WIDTH
    # Four segments of uneven lengths, one empty (the ops' one layout, hadw_kernels/batch/token_layout.py).
    cu_seqlens = torch.tensor([0, WIDTH - 3, WIDTH - 3, 3 * WIDTH, rows])
    logprobs = -torch.rand(rows)
    check("surrogate_loss", logprobs=logprobs, old_logprobs=logprobs - 0.1,
          response_mask=torch.rand(rows) > 0.2, cu_seqlens=cu_seqlens, rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
          advantages=None, response_advantages=None, anchor=torch.tensor(0.4, dtype=torch.float64) if with_optional else None,
          ref_logprobs=logprobs + 0.05 if with_optional else None,
          importance_weights=torch.rand(rows) + 0.5 if with_optional else None,
          entropy=torch.rand(rows) if with_optional else None, selected=None, batch_totals=None, prior=None, **config.kernel_options(), backend="cpp")
    hidden, weight = torch.randn(rows, HIDDEN), torch.randn(VOCAB, HIDDEN)
    bias = torch.randn(VOCAB) if with_optional else None
    labels = torch.randint(0, VOCAB, (rows,))
    labels[::5] = -100
    options = dict(temperature=0.7, ignore_index=-100)
    check("linear_logprob_forward", hidden=hidden, weight=weight, bias=bias, labels=labels,
          with_entropy=with_optional, backend="cpp", **options)
    _, _, lse, mean_logit = torch.ops.hadw.linear_logprob_forward(hidden, weight, bias, labels, 0.7, -100, True, "cpp")
    check("linear_logprob_backward", grad_logprobs=torch.randn(rows),
          grad_entropy=torch.randn(rows) if with_optional else None, hidden=hidden, weight=weight, bias=bias,
          labels=labels, lse=lse, mean_logit=mean_logit, backend="cpp", **options)
    check("linear_surrogate_forward", hidden=hidden, weight=weight, bias=bias, labels=labels,
          old_logprobs=-torch.rand(rows) - 2, advantages=torch.randn(rows),
          agg_weights=torch.full((rows,), 0.1, dtype=torch.float64),
          ref_logprobs=-torch.rand(rows) - 2 if with_optional else None, importance_weights=None,
          **config.token_options(), with_entropy=with_optional, block_rows=0, backend="cpp", **options)


@pytest.mark.skipif("cpp" not in available_backends("cpu"), reason="no cpp backend here")
def test_moving_float_anchor_recompiles_once():
    """The anchor moves every step (DifficultyAnchor.update). As a Python float it is a
    symbolic float after one automatic-dynamic recompile; the cpp backend once filled a
    tensor with float(anchor), which specialised every graph to one value."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    options = {key: value for key, value in OPTIONS.items() if key != "anchor"}

    def fn(logprobs, old, rewards, mask, anchor):
        return fused_hadw_grpo_loss(logprobs, old, rewards, mask, anchor=anchor, backend="cpp", **options)

    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    leaves, others = _batch("surrogate", 4)
    for anchor in (0.4, 0.5, 0.6, 0.7):
        _assert_same(_run(lambda *t, a=anchor: compiled(*t, a), leaves, others),
                     _run(lambda *t, a=anchor: fn(*t, a), leaves, others))
    assert counter.frame_count == 2


def test_moving_loss_normalizer_recompiles_once_on_torch():
    """A per-step loss_normalizer (gradient accumulation) is a symbolic float on the torch
    backend after one recompile. (The cpp and triton ops take it as a float argument, which
    specialises: docs/architecture.md says how to keep one graph there.)"""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def fn(logprobs, old, rewards, mask, normalizer):
        return fused_hadw_grpo_loss(logprobs, old, rewards, mask, group_size=2, loss_type="dapo",
                                    loss_normalizer=normalizer, return_metrics=True, backend="torch")

    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    leaves, others = _batch("surrogate", 4)
    for normalizer in (30.0, 40.0, 50.0):
        _assert_same(_run(lambda *t, n=normalizer: compiled(*t, n), leaves, others),
                     _run(lambda *t, n=normalizer: fn(*t, n), leaves, others))
    assert counter.frame_count == 2
