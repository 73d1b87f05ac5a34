"""One dispatch: the device key picks the kernel, the ``backend`` argument names whose.

Every public ``hadw::`` op has one kernel per device key (CPU, CUDA): :func:`_router`,
which runs the implementation that the named backend registered for the tensors'
device type, or raises :class:`BackendUnavailable` saying why there is none. No backend
ever runs another's code, and autograd, fake tensors and ``torch.compile`` see the same
op whichever kernel serves it. Backends register with :func:`register_kernel` when
their module is imported (``hadw_kernels.backends``). The library calls the ops through
:func:`call`, which runs the same implementation without the dispatcher where nothing
could observe the op.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch.autograd import profiler as _autograd_profiler  # (its flag is read on each call)

from .schemas import LIBRARY, OPS, argument_names, tensor_positions


class BackendUnavailable(RuntimeError):
    """The named backend cannot serve these tensors here (the message says why)."""


_KERNELS: dict[tuple[str, str, str], Callable] = {}
# (backend, device type) of every registered kernel: a call asks whether its backend serves.
_SERVED: set[tuple[str, str]] = set()
# Why a backend has no kernel for a device type, for the error message.
_REASONS: dict[tuple[str, str], str] = {}


def register_kernel(op: str, backend: str, device_type: str, implementation: Callable) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    _KERNELS[(op, backend, device_type)] = implementation
    _SERVED.add((backend, device_type))


def set_unavailable_reason(backend: str, device_type: str, reason: str) -> None:
    _REASONS[(backend, device_type)] = reason


def serves(backend: str, device_type: str) -> bool:
    return (backend, device_type) in _SERVED


def has_kernel(op: str, backend: str, device_type: str) -> bool:
    return (op, backend, device_type) in _KERNELS


def unavailable_message(backend: str, device: torch.device | str) -> str:
    device_type = torch.device(device).type
    reason = _REASONS.get((backend, device_type), f"it has no kernels for {device_type} tensors")
    return f"backend {backend!r} cannot run on {device_type} tensors: {reason}"


def _device_of(arguments) -> torch.device:
    for argument in arguments:
        if isinstance(argument, torch.Tensor):
            return argument.device
    raise ValueError("a hadw op was called without tensors")


def _router(op: str) -> Callable:
    def kernel(*arguments):
        *inputs, backend = arguments
        device = _device_of(inputs)
        implementation = _KERNELS.get((op, backend, device.type))
        if implementation is None:
            raise BackendUnavailable(unavailable_message(backend, device))
        return implementation(*inputs)

    kernel.__name__ = f"{op}_router"
    return kernel


for _op in OPS:
    torch.library.impl(f"{LIBRARY}::{_op}", ["CPU", "CUDA"])(_router(_op))


def call(name: str, **arguments):
    """Calls ``hadw::<name>`` with its arguments given by name (all of them).

    A call nothing needs to observe runs the implementation the op's device kernel would
    pick, without the dispatcher: its two passes box every argument into Python and back,
    much of a small call's host time on the CPU (docs/benchmarks.md, "Host time of a
    small call"). Whatever must see the op goes through it: torch.compile, fake tensors
    and other subclasses, a dispatch or function mode, functorch's transforms, the
    profiler, and autograd (a tensor that requires grad)."""
    names, values_of, tensors_at = _SIGNATURES[name]
    if arguments.keys() != names:
        missing, unknown = names - set(arguments), set(arguments) - names
        raise TypeError(f"hadw::{name}: missing arguments {sorted(missing)}, unknown {sorted(unknown)}")
    if torch.compiler.is_compiling():  # Dynamo traces the op (and no itemgetter)
        return getattr(torch.ops.hadw, name)(*(arguments[key] for key in argument_names(name)))
    values = values_of(arguments)
    device = _unobserved_device([values[index] for index in tensors_at])
    if device is not None:
        implementation = _KERNELS.get((name, values[-1], device.type))
        if implementation is not None:
            return implementation(*values[:-1])
    return getattr(torch.ops.hadw, name)(*values)


# Per op, read once: its argument names, a getter of their values in the schema's order,
# and where its tensors are.
_SIGNATURES = {
    _op: (frozenset(argument_names(_op)), operator.itemgetter(*argument_names(_op)), tensor_positions(_op))
    for _op in OPS
}


def _unobserved_device(tensors) -> torch.device | None:
    """The device of an eager call nothing observes (:func:`call`) with these tensor
    arguments (None for an optional one not given), or None."""
    if (_dispatch_modes() > 0 or _function_mode_enabled() or _autograd_profiler._is_profiler_enabled
            or _functorch_transform() is not None):
        return None
    device = None
    for tensor in tensors:
        if tensor is not None:
            if type(tensor) is not torch.Tensor or tensor.requires_grad:
                return None
            device = device or tensor.device
    return device


# What could observe an op, looked up once (their dotted paths cost a small call more).
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_functorch_transform = torch._C._functorch.peek_interpreter_stack
