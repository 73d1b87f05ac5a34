"""One dispatch: the device key picks the kernel, the ``backend`` argument names whose.

Every public ``hadw::`` op has one kernel per device key (CPU, CUDA): :func:`_router`,
which runs the implementation that the named backend registered for the tensors'
device type, or raises :class:`BackendUnavailable` saying why there is none. No backend
ever runs another's code, and autograd, fake tensors and ``torch.compile`` see the same
op whichever kernel serves it. Backends register with :func:`register_kernel` when
their module is imported (``hadw_kernels.backends``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .schemas import LIBRARY, OPS


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
