"""Compiles every Triton kernel launch of representative calls to cubins for A100
(sm_80) and H100 (sm_90), without a GPU and without launching: the interpreter accepts
code the compiler rejects (globals that are not constexpr, for one). Run by
tests/test_triton_specific.py in a child process without TRITON_INTERPRET."""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

from hadw_kernels.triton import linear_logprob, scale, surrogate

launches = []


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


scale.SMALLEST_FOR_KERNEL = 0  # the kernel, not mul_, on these small tensors
for module in (surrogate, linear_logprob, scale):
    for name, value in list(vars(module).items()):
        if isinstance(value, JITFunction) and name.endswith("_kernel"):
            setattr(module, name, Recorder(value))

batch, width = 8, 64
mask = torch.ones(batch * width, dtype=torch.bool)
cu_seqlens = torch.arange(batch + 1) * width
for dtype in (torch.bfloat16, torch.float32):
    values = lambda: torch.zeros(batch * width, dtype=dtype)  # noqa: E731
    for sequence_level, weights, agg_mode in ((False, torch.ones(batch * width), 0), (True, None, 1),
                                              (False, None, 3)):
        for kl_estimator in range(4):
            surrogate.surrogate_forward(
                values(), values(), mask, cu_seqlens, torch.zeros(batch), None, torch.tensor(0.5), values(), weights,
                values(), 4, True, 1e-6, 1.3, agg_mode, sequence_level, 0.2, 0.28, 3.0, 0.1, kl_estimator, 0.01,
                None, width)
    surrogate.surrogate_forward(
        values(), values(), mask, cu_seqlens, None, torch.zeros(batch), None, None, None, None,
        None, False, 1e-6, 1.3, 2, False, 0.2, 0.28, None, 0.0, 2, 0.0, 10.0, 64)
    hidden = torch.zeros(batch * width, 32, dtype=dtype)
    weight = torch.zeros(100, 32, dtype=dtype)
    bias = torch.zeros(100, dtype=dtype)
    labels = torch.zeros(batch * width, dtype=torch.long)
    row = torch.zeros(batch * width)
    linear_logprob.linear_logprob_forward(hidden, weight, bias, labels, 0.7, -100, True)
    linear_logprob.linear_logprob_backward(row, row, hidden, weight, bias, labels, row, row, 0.7, -100)
    for kl_estimator in range(4):
        linear_logprob.linear_surrogate_forward(
            hidden, weight, bias, labels, row, row, row, row, row, 0.7, -100, 0.2, 0.28, 3.0, 0.1, kl_estimator,
            0.01, True, 16)
    linear_logprob.linear_surrogate_forward(
        hidden, weight, None, labels, None, row, row, None, None, 1.0, -100, 0.2, 0.2, None, 0.0, 2, 0.0, False, 0)
    scale.scale_in_place_(weight, torch.ones(()))
scale.scale_in_place_(torch.zeros(3, dtype=torch.float64), torch.ones((), dtype=torch.float64))

compiled = set()
for kernel, args, kwargs in launches:
    options = {"num_warps": kwargs.pop("num_warps")}
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = param.annotation_type or mangle_type(value)
    key = (kernel.__name__, tuple(signature.values()), tuple(map(str, constexprs.items())))
    if key in compiled:
        continue
    compiled.add(key)
    for capability in sys.argv[1:] or ("80", "90"):
        triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", int(capability), 32),
                       options=options)
print(sorted({name for name, *_ in compiled}))
print(len(compiled), "variants compiled")
