"""Host overhead of a call (docs/architecture.md, "Host synchronisation"): with
``check_values=False`` no tensor value reaches Python, with the default checks one read
does (every screen in one flag vector, and the linear loss's count of active rows); the
rows that enter the linear loss's GEMMs on either; and the Triton kernels' launches.

On the CPU a host read is no device synchronisation, but it is the same operator that is
one on CUDA: the operators that read a value (``_local_scalar_dense``, ``is_nonzero``,
``nonzero``) fail the forward, seen by a dispatch mode that also runs inside the hadw ops'
implementations, and every way Python reads a tensor's value is patched to raise or to
count. (The CUDA check with the synchronisation debug mode is in test_triton_specific.py
and needs a GPU.)"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hadw_kernels import (
    RolloutCorrection,
    available_backends,
    batch_totals,
    fused_hadw_grpo_loss,
    fused_linear_hadw_grpo_loss,
    token_logprobs,
)
from hadw_kernels.ops import routing
from hadw_kernels.tables.linear_blocks import block_rows_for

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
HOST_BACKENDS = [
    pytest.param(name, marks=[] if name in available_backends("cpu") else [pytest.mark.skip(reason=f"no {name}")])
    for name in ("torch", "cpp", "triton")
]
LAYOUTS = ("padded", "packed")


class _Reads:
    """Patches every host read of a tensor: ``refuse`` raises, otherwise they are counted."""

    def __init__(self, monkeypatch, refuse):
        self.count = 0
        self.refuse = refuse
        self.inside = False  # in a patched read (whose own operator is not a second read)
        for method in READS:
            original = getattr(torch.Tensor, method)
            monkeypatch.setattr(torch.Tensor, method, self._wrap(method, original))

    def _wrap(self, method, original):
        def read(tensor, *args, **kwargs):
            if self.refuse:
                raise AssertionError(f"Tensor.{method}: a tensor value was read on the host")
            self.count += 1
            self.inside = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self.inside = False

        return read


class _Operators(TorchDispatchMode):
    """Sees every operator of a call: a hadw op's implementation runs under this mode too
    (as ``ops.call``'s router would run it), so the Python around a backend's kernels is
    seen as well."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func._schema.name.split("::")
        self.seen(name if namespace == "aten" else None, args, kwargs or {})
        if namespace == "hadw":
            *inputs, backend = args
            device = next(value.device for value in inputs if isinstance(value, torch.Tensor))
            with self:
                return routing._KERNELS[(name, backend, device.type)](*inputs)
        return func(*args, **(kwargs or {}))

    def seen(self, name, args, kwargs):
        pass


class _HostReadOperators(_Operators):
    """Raises at an operator that reads a tensor's value on the host (on a GPU each waits
    for the device), or with ``reads`` counts it there unless a patched read of ``reads``
    runs it."""

    NAMES = ("_local_scalar_dense", "is_nonzero", "nonzero")

    def __init__(self, reads: _Reads | None = None):
        super().__init__()
        self.reads = reads

    def seen(self, name, args, kwargs):
        if name not in self.NAMES:
            return
        if self.reads is None:
            raise AssertionError(f"aten::{name}: a tensor value was read on the host")
        if not self.reads.inside:
            self.reads.count += 1


class _LogitRows(_Operators):
    """The rows of every GEMM that forms logits, h W^T: its product has ``vocab``
    columns (the gradient GEMMs' have H; the head's gradient is [V, H])."""

    GEMMS = ("mm", "addmm")

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.rows = []

    def seen(self, name, args, kwargs):
        if name in self.GEMMS:
            left, right = args[-2:] if name == "mm" else args[1:3]
            if right.shape[-1] == self.vocab:
                self.rows.append(left.shape[0])


def _tokens(layout, batch, width, values):
    """A per-token tensor [B, T] as the layout passes it: padded as it is, packed as [N]
    (the padded rows' segments of ``width`` tokens each, padding masked)."""
    return values if layout == "padded" else values.reshape(batch * width, *values.shape[2:])


def _packing(layout, batch, width):
    return {} if layout == "padded" else {"cu_seqlens": torch.arange(batch + 1) * width}


def _surrogate_call(backend, check_values, layout="padded"):
    logprobs = -torch.rand(4, 6)
    mask = torch.ones(4, 6)
    mask[:, -2:] = 0
    leaf = _tokens(layout, 4, 6, logprobs).requires_grad_()
    loss = fused_hadw_grpo_loss(
        leaf, _tokens(layout, 4, 6, logprobs - 0.1), torch.tensor([1.0, 0.0, 1.0, 1.0]), _tokens(layout, 4, 6, mask),
        group_size=2, anchor=torch.tensor(0.4), beta=0.04, ref_logprobs=_tokens(layout, 4, 6, logprobs + 0.05),
        return_metrics=True, backend=backend, check_values=check_values, **_packing(layout, 4, 6),
    )
    return loss, [leaf]


def _token_mean_call(backend, check_values, layout="padded"):
    """dapo: token-mean, whose count of the batch's tokens the kernels form with the gradients."""
    logprobs = -torch.rand(4, 6)
    mask = torch.ones(4, 6)
    mask[:, -2:] = 0
    leaf = _tokens(layout, 4, 6, logprobs).requires_grad_()
    loss = fused_hadw_grpo_loss(
        leaf, _tokens(layout, 4, 6, logprobs - 0.1), None, _tokens(layout, 4, 6, mask),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), loss_type="dapo", return_metrics=True, backend=backend,
        check_values=check_values, **_packing(layout, 4, 6),
    )
    return loss, [leaf]


def _linear_call(backend, check_values, layout="padded", **options):
    hidden = torch.randn(4, 6, 8)
    weight = torch.randn(16, 8, requires_grad=True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, -2:] = False
    leaf = _tokens(layout, 4, 6, hidden).requires_grad_()
    loss = fused_linear_hadw_grpo_loss(
        leaf, weight, _tokens(layout, 4, 6, torch.randint(0, 16, (4, 6))),
        _tokens(layout, 4, 6, -torch.rand(4, 6) - 2), torch.tensor([1.0, 0.0, 1.0, 1.0]), _tokens(layout, 4, 6, mask),
        group_size=2, anchor=0.4, return_metrics=True, backend=backend, check_values=check_values,
        **_packing(layout, 4, 6), **options,
    )
    return loss, [leaf, weight]


def _token_logprobs_call(backend, check_values, layout="padded"):
    """``token_logprobs`` alone, its summed log-probs, the last two labels of each row of
    six ignored."""
    shape = (4, 6) if layout == "padded" else (24,)
    hidden = torch.randn(*shape, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    labels = torch.randint(0, 16, (4, 6))
    labels[:, -2:] = -100
    logprobs = token_logprobs(hidden, weight, labels.view(shape), backend=backend, check_values=check_values)
    return (logprobs.sum(), {}), [hidden, weight]


def _recomputed_linear_call(backend, check_values, layout="padded"):
    """The linear loss's other path: log-probs first, backward recomputing the logits."""
    return _linear_call(backend, check_values, layout, loss_type="gspo")


def _corrected_surrogate_call(backend, check_values, layout="padded"):
    """Every rule of the rollout correction and both token masks, batch-normalised."""
    logprobs = -torch.rand(4, 6)
    mask = torch.ones(4, 6)
    mask[:, -2:] = 0
    leaf = _tokens(layout, 4, 6, logprobs).requires_grad_()
    correction = RolloutCorrection(level="token", rule="mask", lower=0.5, upper=2.0, batch_normalize=True,
                                   rejection={"seq_max_k3": 0.5, "token_k1": (0.5, 2.0)})
    loss = fused_hadw_grpo_loss(
        leaf, _tokens(layout, 4, 6, logprobs - 0.1), torch.tensor([1.0, 0.0, 1.0, 1.0]), _tokens(layout, 4, 6, mask),
        group_size=2, anchor=torch.tensor(0.4), rollout_logprobs=_tokens(layout, 4, 6, logprobs - 0.15),
        rollout_correction=correction, off_policy_mask_threshold=0.1, top_entropy_quantile=0.5,
        entropy=_tokens(layout, 4, 6, torch.rand(4, 6)), return_metrics=True, backend=backend,
        check_values=check_values, **_packing(layout, 4, 6),
    )
    return loss, [leaf]


def _corrected_linear_call(backend, check_values, layout="padded"):
    old = -torch.rand(4, 6) - 2
    return _linear_call(backend, check_values, layout, rollout_logprobs=_tokens(layout, 4, 6, old - 0.05),
                        rollout_correction=RolloutCorrection())


CALLS = {"surrogate": _surrogate_call, "token_mean": _token_mean_call, "linear": _linear_call,
         "recomputed_linear": _recomputed_linear_call, "corrected_surrogate": _corrected_surrogate_call,
         "corrected_linear": _corrected_linear_call, "token_logprobs": _token_logprobs_call}
# The linear loss's gradients-in-forward path (cpp and triton): its backward's shortcut for
# an upstream gradient of exactly 1 on the CPU reads that value (ops/autograd.py).
GRADIENTS_IN_FORWARD = ("linear", "corrected_linear")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("loss", list(CALLS))
def test_unchecked_forward_reads_no_value(monkeypatch, loss, backend, layout):
    """check_values=False: no operator of the forward reads a value on the host, inside the
    backends' implementations too, and Python reads none."""
    _Reads(monkeypatch, refuse=True)
    with _HostReadOperators():
        value, metrics = CALLS[loss](backend, check_values=False, layout=layout)[0]
    monkeypatch.undo()
    assert torch.isfinite(value) and all(torch.isfinite(metric) for metric in metrics.values())


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("loss", list(CALLS))
def test_unchecked_call_reads_no_value(monkeypatch, loss, backend):
    """check_values=False: the forward and the backward read no tensor value in Python,
    except the cpp/triton linear loss's shortcut for an upstream gradient of exactly 1 on
    the CPU (ops/autograd.py), one read of host memory that is no device synchronisation
    and is not taken on CUDA."""
    reads = _Reads(monkeypatch, refuse=True)
    (value, metrics), leaves = CALLS[loss](backend, check_values=False)
    reads.refuse = False
    value.backward()
    monkeypatch.undo()
    gradients_in_forward = loss in GRADIENTS_IN_FORWARD and backend != "torch"
    assert reads.count == (1 if gradients_in_forward else 0)
    assert torch.isfinite(value) and all(torch.isfinite(leaf.grad).all() for leaf in leaves)
    assert all(torch.isfinite(metric) for metric in metrics.values())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("loss", list(CALLS))
def test_checked_call_reads_once(monkeypatch, loss, backend, layout):
    """The default value checks read one flag vector: one synchronisation on CUDA. The
    linear loss's count of active rows rides in it, and no other operator reads a value
    (the rows are found without one, inside the backends too)."""
    reads = _Reads(monkeypatch, refuse=False)
    with _HostReadOperators(reads):
        (value, _), _ = CALLS[loss](backend, check_values=True, layout=layout)
    forward_reads = reads.count
    monkeypatch.undo()
    assert forward_reads == 1
    assert torch.isfinite(value)


# The calls of the linear loss's sweep, and how many sweeps form logits: one on the
# gradients-in-forward path, a forward and a backward on the recompute one (the torch
# backend's only one, and token_logprobs').
SWEEPS = {("linear", "triton"): 1, ("linear", "torch"): 2, ("recomputed_linear", "triton"): 2,
          ("recomputed_linear", "torch"): 2, ("token_logprobs", "triton"): 2, ("token_logprobs", "torch"): 2}


@pytest.mark.parametrize("check_values", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", [param for param in HOST_BACKENDS if param.values[0] != "cpp"])
@pytest.mark.parametrize("loss", ["linear", "recomputed_linear", "token_logprobs"])
def test_rows_that_enter_the_gemms(loss, backend, layout, check_values):
    """With the value checks (the default) only the 16 active rows of 24 form logits (the
    rows of padding, or of a packed batch's positions outside the responses, and of
    ignored labels are left out), on both paths and in both layouts; without them (no
    count is read) every row does. Either way an inactive row's gradient is zero. The C++
    kernels, whose GEMMs are not aten operators, find the active rows themselves."""
    counted = _LogitRows(vocab=16)
    with counted:
        (value, _), leaves = CALLS[loss](backend, check_values=check_values, layout=layout)
        value.backward()
    assert counted.rows == [16 if check_values else 24] * SWEEPS[loss, backend]
    grad_hidden = leaves[0].grad.reshape(4, 6, -1)
    assert torch.isfinite(grad_hidden).all() and torch.all(grad_hidden[:, -2:] == 0)
    assert torch.any(grad_hidden[:, :-2] != 0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in available_backends("cpu"),
                    reason="counts launches under Triton's interpreter")
def test_triton_launches_per_call(monkeypatch):
    """The Triton launches of each path (docs/architecture.md, "Triton: launches"): the
    surrogate one in its forward for every objective, ratio form and aggregation, none in
    backward (the gradient formed in the forward is scaled by torch.mul, ops/autograd.py);
    the linear loss's gradients-in-forward path two a block of rows and the surrogate's
    one, none in backward; its recompute path one a block each way and the surrogate's."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)

    def launches_of(call):
        launches.clear()
        loss = call()
        forward = list(launches)
        launches.clear()
        loss.backward()
        return forward, list(launches)

    logprobs = (-torch.rand(8, 5)).requires_grad_()
    mask = torch.ones(8, 5, dtype=torch.bool)
    common = dict(backend="triton", check_values=False, beta=0.04, ref_logprobs=logprobs.detach())
    sources = (dict(rewards=torch.tensor([1.0, 0.0] * 4), group_size=2, anchor=0.3),
               dict(rewards=None, advantages=torch.randn(8)), dict(rewards=None, advantages=torch.randn(8, 5)))
    for loss_type in ("grpo", "gspo", "dapo", "luspo", "dr_grpo", "vespo", "gmpo"):
        for data in sources:
            forward, backward = launches_of(lambda loss_type=loss_type, data=data: fused_hadw_grpo_loss(
                logprobs, logprobs.detach() + 0.1, response_mask=mask, loss_type=loss_type, **data, **common))
            assert (forward, backward) == (["_surrogate_kernel"], []), (loss_type, data.keys())

    # Every estimator inside that launch (tables/estimators.py); James-Stein without the
    # batch's totals first reduces the call's groups' (one program).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    estimators = {
        "rloo": ({}, ["_surrogate_kernel"]),
        "prompt_history": ({"prior": torch.full((8, 2), 1.5)}, ["_surrogate_kernel"]),
        "james_stein": ({"batch_totals": batch_totals(rewards, group_size=2)}, ["_surrogate_kernel"]),
        None: ({}, ["_totals_kernel", "_surrogate_kernel"]),
    }
    for estimator, (inputs, expected) in estimators.items():
        forward, backward = launches_of(lambda estimator=estimator, inputs=inputs: fused_hadw_grpo_loss(
            logprobs, logprobs.detach() + 0.1, rewards, mask, group_size=2, anchor=0.3, loss_type="dr_grpo",
            advantage_estimator=estimator or "james_stein", **inputs, **common))
        assert (forward, backward) == (expected, []), estimator

    # The gradients-in-forward path in three blocks of rows, the last one short; the
    # recompute path's ops plan their own (linear_blocks.block_rows_for): one.
    rows, block_rows = 8 * 5, 16
    hidden = torch.randn(8, 5, 4, requires_grad=True)
    weight = torch.randn(11, 4, requires_grad=True)
    labels = torch.randint(0, 11, (8, 5))
    blocks = -(-rows // block_rows)
    assert block_rows_for(rows, 11, 4, "cpu") >= rows
    for path, expected in (("gradients_in_forward", (["_row_surrogate_kernel", "_logit_gradient_kernel"] * blocks
                                                     + ["_surrogate_kernel"], [])),
                           ("recompute", (["_row_stats_kernel", "_surrogate_kernel"], ["_logit_gradient_kernel"]))):
        launched = launches_of(lambda path=path: fused_linear_hadw_grpo_loss(
            hidden, weight, labels, None, torch.tensor([1.0, 0.0] * 4), mask, group_size=2, backend="triton",
            check_values=False, linear_path=path, block_rows=block_rows))
        assert launched == expected, path


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("loss_type, reads", [("clip_cov", 1), ("kl_cov", 0)])
def test_a_selecting_objective_reads_its_counts(monkeypatch, loss_type, reads, backend):
    """clip_cov reads the counted tokens (how many to draw) besides the candidates'
    `nonzero`, kl_cov only its `nonzero` (no patched read): the host reads
    docs/architecture.md names for them, and no other."""
    logprobs = (-torch.rand(4, 6, generator=torch.Generator().manual_seed(0))).requires_grad_()
    counted = _Reads(monkeypatch, refuse=False)
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, logprobs.detach() - 0.1, None, torch.ones(4, 6), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        loss_type=loss_type, return_metrics=True, backend=backend, check_values=False,
        clip_cov_lb=-10.0 if loss_type == "clip_cov" else None,
    )
    assert counted.count == reads
    monkeypatch.undo()
    assert metrics["selected_frac"].item() > 0 and torch.isfinite(loss)
