"""One dispatch: the device key picks the kernel, the backend name picks whose, and a
backend that cannot serve the tensors' device says so instead of running other code."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from hadw_kernels import BackendUnavailable, available_backends, fused_hadw_grpo_loss
from hadw_kernels.backends import BACKENDS, Backend, load_backend, resolve_backend
from hadw_kernels.backends.protocol import LinearSurrogate

# What each backend serves when everything it needs is present.
SERVES = {"torch": {"cpu", "cuda"}, "triton": {"cuda"}, "cpp": {"cpu"}}


def test_every_backend_declares_its_devices():
    assert set(SERVES) == set(BACKENDS)


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values() if p.name != "self"]


def test_backend_satisfies_the_protocol(backend):
    """Every member of ``Backend``, with the Protocol's parameter names and kinds (a
    runtime-checkable Protocol checks only that the members exist)."""
    implementation = load_backend(backend)
    assert isinstance(implementation, Backend)
    for member in ("serves", "unavailable_message", "has_gradients_in_forward", "surrogate_loss", "token_logprobs"):
        assert _parameters(getattr(implementation, member)) == _parameters(getattr(Backend, member)), member
    linear = implementation.linear_surrogate
    if linear is not None:
        assert _parameters(linear) == _parameters(LinearSurrogate.__call__)


@pytest.mark.parametrize("name", [name for name in BACKENDS if name != "torch"])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_backend_that_cannot_serve_a_device_says_why(name, device_type):
    try:
        backend = load_backend(name)
    except BackendUnavailable as error:
        assert name in str(error)
        return
    if backend.serves(torch.device(device_type)):
        assert device_type in SERVES[name] or (name == "triton" and os.environ.get("TRITON_INTERPRET") == "1")
        return
    with pytest.raises(BackendUnavailable) as raised:
        resolve_backend(name, torch.device(device_type))
    assert repr(name) in str(raised.value) and device_type in str(raised.value)


def test_triton_on_cpu_tensors_without_the_interpreter_says_why():
    code = (
        "import torch; from hadw_kernels import fused_hadw_grpo_loss\n"
        "x = torch.zeros(2, 3)\n"
        "fused_hadw_grpo_loss(x, x, torch.tensor([1.0, 0.0]), torch.ones(2, 3), group_size=2, backend='triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "BackendUnavailable" in result.stderr and "'triton'" in result.stderr and "cpu" in result.stderr
    assert "TRITON_INTERPRET" in result.stderr


def test_the_op_router_refuses_a_backend_without_kernels_for_the_device():
    """Below the public functions the op itself refuses: no other backend's kernel runs."""
    from hadw_kernels import ops

    x = torch.zeros(2, 3)
    with pytest.raises(BackendUnavailable, match="'no-such-backend' cannot run on cpu"):
        ops.call("linear_logprob_forward", hidden=x, weight=torch.zeros(5, 3), bias=None,
                 labels=torch.zeros(2, dtype=torch.long), temperature=1.0, ignore_index=-100, with_entropy=False,
                 backend="no-such-backend")


def test_torch_backend_is_always_available(device):
    assert "torch" in available_backends(device)


def test_auto_picks_the_preferred_available_backend(device):
    preferred = {"cuda": ("triton", "torch"), "cpu": ("cpp", "torch")}[device.type]
    expected = next(name for name in preferred if name in available_backends(device))
    assert resolve_backend("auto", device) is load_backend(expected)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend"):
        load_backend("cuda-magic")


def _surrogate_arguments(config, dtype, device) -> dict:
    """``surrogate_loss``'s arguments: four segments of 20 tokens, one empty (hadw_kernels/batch/token_layout.py)."""
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(20, generator=generator)).to(dtype=dtype, device=device)
    return dict(logprobs=logprobs, old_logprobs=logprobs.flip(0), response_mask=torch.ones(20, dtype=torch.bool,
                device=device), cu_seqlens=torch.tensor([0, 5, 5, 12, 20], device=device),
                rewards=torch.tensor([1.0, 0, 0, 1], device=device), advantages=None, response_advantages=None,
                anchor=None, ref_logprobs=None, importance_weights=None, entropy=logprobs, selected=None, batch_totals=None, prior=None,
                **config.kernel_options())


def test_outputs_match_the_fake_implementation(backend, device):
    """Shapes and dtypes of every op equal its fake (meta) outputs, which torch.compile trusts."""
    from hadw_kernels import ops
    from hadw_kernels.config.loss_config import LossConfig

    config = LossConfig.build("grpo", 2, entropy_coef=0.01)
    for dtype in (torch.float32, torch.bfloat16):
        surrogate = _surrogate_arguments(config, dtype, device)
        hidden, weight = torch.zeros(6, 8, dtype=dtype, device=device), torch.zeros(11, 8, dtype=dtype, device=device)
        labels, rows = torch.zeros(6, dtype=torch.long, device=device), torch.zeros(6, device=device)
        calls = {
            "surrogate_loss": surrogate,
            "linear_logprob_forward": dict(hidden=hidden, weight=weight, bias=None, labels=labels, temperature=1.0,
                                           ignore_index=-100, with_entropy=True),
            "linear_logprob_backward": dict(grad_logprobs=rows, grad_entropy=rows, hidden=hidden, weight=weight,
                                            bias=None, labels=labels, lse=rows, mean_logit=rows, temperature=1.0,
                                            ignore_index=-100),
            "linear_surrogate_forward": dict(hidden=hidden, weight=weight, bias=None, labels=labels, old_logprobs=None,
                                             advantages=rows, agg_weights=rows, ref_logprobs=None,
                                             importance_weights=None, temperature=1.0, ignore_index=-100,
                                             **config.token_options(), with_entropy=True, block_rows=0),
        }
        for op, arguments in calls.items():
            if backend == "torch" or not ops.has_kernel(op, backend, device.type):
                continue
            real = ops.call(op, **arguments, backend=backend)
            meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in arguments.items()}
            fake = ops.call(op, **meta, backend=backend)
            for index, (out, expected) in enumerate(zip(real, fake)):
                assert (out.shape, out.dtype) == (expected.shape, expected.dtype), (op, index)


def test_an_unobserved_call_skips_the_dispatcher_and_every_observer_sees_the_op(backend, device, monkeypatch):
    """``ops.call`` runs a backend's kernel without the dispatcher only when nothing could
    observe the op (hadw_kernels/ops/routing.py): the same outputs either way, and a
    dispatch mode, the profiler and autograd see ``hadw::surrogate_loss``. The dispatcher
    calls a kernel from the op's router, ``ops.call`` from itself: the caller tells them apart."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hadw_kernels import ops
    from hadw_kernels.config.loss_config import LossConfig
    from hadw_kernels.ops import routing

    if backend == "torch":
        pytest.skip("the torch backend calls no op")
    key = ("surrogate_loss", backend, device.type)
    kernel = routing._KERNELS[key]
    dispatched_calls = []

    def observed_kernel(*arguments):
        dispatched_calls.append(sys._getframe(1).f_code.co_name == "kernel")  # routing._router's kernel
        return kernel(*arguments)

    monkeypatch.setitem(routing._KERNELS, key, observed_kernel)
    arguments = _surrogate_arguments(LossConfig.build("grpo", 2, entropy_coef=0.01), torch.float32, device)

    def surrogate():
        return ops.call("surrogate_loss", **arguments, backend=backend)

    direct = surrogate()
    dispatched = torch.ops.hadw.surrogate_loss(*(arguments[name] for name in ops.argument_names("surrogate_loss")
                                                 if name != "backend"), backend)
    assert dispatched_calls == [False, True]
    for out, expected in zip(direct, dispatched):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        surrogate()
    assert "hadw.surrogate_loss.default" in seen.ops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        surrogate()
    assert "hadw::surrogate_loss" in {event.name for event in profile.events()}
    arguments["logprobs"] = arguments["logprobs"].clone().requires_grad_()
    surrogate()
    assert dispatched_calls[2:] == [True, True, True]


@pytest.mark.slow
def test_loss_compiles_with_torch_compile(backend, device):
    """Without a graph break on every backend, once an eager call has loaded it
    (docs/architecture.md, "torch.compile"; tests/test_compile.py has the rest)."""
    logprobs = -torch.rand(8, 5, device=device, requires_grad=True)
    old = logprobs.detach() + 0.1
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], device=device)
    mask = torch.ones(8, 5, dtype=torch.bool, device=device)

    def step(lp):
        return fused_hadw_grpo_loss(lp, old, rewards, mask, group_size=4, anchor=0.5, check_values=False,
                                    backend=backend)

    eager = step(logprobs)
    compiled = torch.compile(step, fullgraph=True)(logprobs)
    torch.testing.assert_close(compiled, eager)
    (grad_eager,) = torch.autograd.grad(eager, logprobs)
    (grad_compiled,) = torch.autograd.grad(compiled, logprobs)
    torch.testing.assert_close(grad_compiled, grad_eager)


def test_triton_launchers_take_the_schema_arguments_in_order():
    """The Triton kernels are called positionally in the schema's order (ops/routing.py):
    each launcher's parameters are the op's arguments, by name, so a signature change in
    ops/signatures.py that the launcher does not follow fails here, not as a wrong
    argument bound at run time. (The C++ declarations are generated from the same
    signatures.)"""
    triton_backend = pytest.importorskip("hadw_kernels.backends.triton_backend", exc_type=ImportError)
    from hadw_kernels.ops import argument_names

    for op, launcher in triton_backend._IMPLEMENTATIONS.items():
        expected = [name for name in argument_names(op) if name != "backend"]
        assert list(inspect.signature(launcher).parameters) == expected, op
