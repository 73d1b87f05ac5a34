"""Host overhead of a call (docs/architecture.md, "Host synchronisation"): with
``check_values=False`` no tensor value reaches Python, with the default checks one read
does (every screen in one flag vector); and the Triton surrogate's kernel launches.

On the CPU a host read is no device synchronisation, but it is the same Python call
that is one on CUDA: every way Python reads a tensor's value is patched to raise or to
count. (The CUDA check with the synchronisation debug mode is in
test_triton_specific.py and needs a GPU.)"""

import os

import pytest
import torch

from hadw_kernels import RolloutCorrection, available_backends, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
HOST_BACKENDS = [
    pytest.param(name, marks=[] if name in available_backends("cpu") else [pytest.mark.skip(reason=f"no {name}")])
    for name in ("torch", "cpp", "triton")
]


class _Reads:
    """Patches every host read of a tensor: ``refuse`` raises, otherwise they are counted."""

    def __init__(self, monkeypatch, refuse):
        self.count = 0
        self.refuse = refuse
        for method in READS:
            original = getattr(torch.Tensor, method)
            monkeypatch.setattr(torch.Tensor, method, self._wrap(method, original))

    def _wrap(self, method, original):
        def read(tensor, *args, **kwargs):
            if self.refuse:
                raise AssertionError(f"Tensor.{method}: a tensor value was read on the host")
            self.count += 1
            return original(tensor, *args, **kwargs)

        return read


def _surrogate_call(backend, check_values):
    logprobs = (-torch.rand(4, 6)).requires_grad_()
    mask = torch.ones(4, 6)
    mask[:, -2:] = 0
    loss = fused_hadw_grpo_loss(
        logprobs, logprobs.detach() - 0.1, torch.tensor([1.0, 0.0, 1.0, 1.0]), mask, group_size=2,
        anchor=torch.tensor(0.4), beta=0.04, ref_logprobs=logprobs.detach() + 0.05, return_metrics=True,
        backend=backend, check_values=check_values,
    )
    return loss, [logprobs]


def _linear_call(backend, check_values):
    hidden = torch.randn(4, 6, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, -2:] = False
    loss = fused_linear_hadw_grpo_loss(
        hidden, weight, torch.randint(0, 16, (4, 6)), -torch.rand(4, 6) - 2, torch.tensor([1.0, 0.0, 1.0, 1.0]),
        mask, group_size=2, anchor=0.4, return_metrics=True, backend=backend, check_values=check_values,
    )
    return loss, [hidden, weight]


def _corrected_surrogate_call(backend, check_values):
    """Every rule of the rollout correction and both token masks, batch-normalised."""
    logprobs = (-torch.rand(4, 6)).requires_grad_()
    mask = torch.ones(4, 6)
    mask[:, -2:] = 0
    correction = RolloutCorrection(level="token", rule="mask", lower=0.5, upper=2.0, batch_normalize=True,
                                   rejection={"seq_max_k3": 0.5, "token_k1": (0.5, 2.0)})
    loss = fused_hadw_grpo_loss(
        logprobs, logprobs.detach() - 0.1, torch.tensor([1.0, 0.0, 1.0, 1.0]), mask, group_size=2,
        anchor=torch.tensor(0.4), rollout_logprobs=logprobs.detach() - 0.15, rollout_correction=correction,
        off_policy_mask_threshold=0.1, top_entropy_quantile=0.5, entropy=torch.rand(4, 6), return_metrics=True,
        backend=backend, check_values=check_values,
    )
    return loss, [logprobs]


def _corrected_linear_call(backend, check_values):
    hidden = torch.randn(4, 6, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, -2:] = False
    old = -torch.rand(4, 6) - 2
    loss = fused_linear_hadw_grpo_loss(
        hidden, weight, torch.randint(0, 16, (4, 6)), old, torch.tensor([1.0, 0.0, 1.0, 1.0]),
        mask, group_size=2, anchor=0.4, rollout_logprobs=old - 0.05, rollout_correction=RolloutCorrection(),
        return_metrics=True, backend=backend, check_values=check_values,
    )
    return loss, [hidden, weight]


CALLS = {"surrogate": _surrogate_call, "linear": _linear_call, "corrected_surrogate": _corrected_surrogate_call,
         "corrected_linear": _corrected_linear_call}


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("loss", list(CALLS))
def test_unchecked_call_reads_no_value(monkeypatch, loss, backend):
    """check_values=False: the forward reads no tensor value. The backward reads none
    either, except the cpp/triton linear loss's shortcut for an upstream gradient of
    exactly 1 on the CPU (ops/autograd.py), one read of host memory that is no device
    synchronisation and is not taken on CUDA."""
    reads = _Reads(monkeypatch, refuse=True)
    (value, metrics), leaves = CALLS[loss](backend, check_values=False)
    reads.refuse = False
    value.backward()
    monkeypatch.undo()
    gradients_in_forward = loss in ("linear", "corrected_linear") and backend != "torch"
    assert reads.count == (1 if gradients_in_forward else 0)
    assert torch.isfinite(value) and all(torch.isfinite(leaf.grad).all() for leaf in leaves)
    assert all(torch.isfinite(metric) for metric in metrics.values())


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("loss", list(CALLS))
def test_checked_call_reads_once(monkeypatch, loss, backend):
    """The default value checks read one flag vector: one synchronisation on CUDA."""
    reads = _Reads(monkeypatch, refuse=False)
    (value, _), _ = CALLS[loss](backend, check_values=True)
    forward_reads = reads.count
    monkeypatch.undo()
    assert forward_reads == 1
    assert torch.isfinite(value)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in available_backends("cpu"),
                    reason="counts launches under Triton's interpreter")
def test_triton_surrogate_launches(monkeypatch):
    """At most 4 kernel launches for the surrogate's forward and backward with rewards
    (response lengths, group advantages with Phi, the per-response surrogate, the final
    reduction), 3 with the caller's advantages (no group kernel), none in backward: the
    gradient is formed in the forward and scaled by one torch.mul (ops/autograd.py)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    logprobs = (-torch.rand(8, 5)).requires_grad_()
    mask = torch.ones(8, 5, dtype=torch.bool)
    common = dict(backend="triton", check_values=False, beta=0.04, ref_logprobs=logprobs.detach())
    for loss_type in ("grpo", "gspo"):
        for data, expected in ((dict(rewards=torch.tensor([1.0, 0.0] * 4), group_size=2, anchor=0.3), 4),
                               (dict(rewards=None, advantages=torch.randn(8)), 3)):
            launches.clear()
            loss = fused_hadw_grpo_loss(logprobs, logprobs.detach() + 0.1, response_mask=mask,
                                        loss_type=loss_type, **data, **common)
            forward = len(launches)
            loss.backward()
            assert forward <= expected, launches
            assert len(launches) == forward, launches


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
