"""Backend selection."""

import os
import subprocess
import sys

import pytest
import torch

from hadw_kernels import available_backends, fused_hadw_grpo_loss
from hadw_kernels.backends import load_backend, resolve_backend


def test_torch_backend_is_always_available():
    assert "torch" in available_backends()


def test_auto_on_cpu_prefers_cpp_then_torch():
    expected = "cpp" if "cpp" in available_backends() else "torch"
    assert resolve_backend("auto", torch.device("cpu")) is load_backend(expected)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend"):
        load_backend("cuda-magic")


def test_triton_on_cpu_without_interpreter_says_why():
    code = (
        "import torch; from hadw_kernels import fused_hadw_grpo_loss\n"
        "x = torch.zeros(2, 3)\n"
        "fused_hadw_grpo_loss(x, x, torch.tensor([1.0, 0.0]), torch.ones(2, 3), group_size=2, backend='triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "BackendUnavailable" in result.stderr and "TRITON_INTERPRET" in result.stderr


def test_loss_compiles_with_torch_compile():
    logprobs = -torch.rand(8, 5, requires_grad=True)
    old = logprobs.detach() + 0.1
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    mask = torch.ones(8, 5, dtype=torch.bool)

    def step(lp):
        return fused_hadw_grpo_loss(lp, old, rewards, mask, group_size=4, anchor=0.5, check_values=False)

    eager = step(logprobs)
    compiled = torch.compile(step, fullgraph=False)(logprobs)
    torch.testing.assert_close(compiled, eager)
    (grad_eager,) = torch.autograd.grad(eager, logprobs)
    (grad_compiled,) = torch.autograd.grad(compiled, logprobs)
    torch.testing.assert_close(grad_compiled, grad_eager)
