"""The backends: one module per implementation, each exposing ``BACKEND``, an object
that satisfies ``protocol.Backend`` (the surrogate loss, the log-probs from hidden
states, the gradients-in-forward linear loss or None, and which devices it serves).

Adding a backend is a module and one line in ``_MODULES``. "auto" picks, for the
tensors' device, the first backend of ``_PREFERRED`` that can serve it.

A backend's module is imported once and its object kept in ``_LOADED``: the "torch"
and "cpp" backends when this package is imported (cheap), "triton" on first use (it
imports Triton). Under ``torch.compile`` the choice is then a dictionary lookup that
Dynamo traces without a graph break (docs/architecture.md, "torch.compile").
"""

from __future__ import annotations

import importlib

import torch

from ..ops import BackendUnavailable
from .protocol import Backend

__all__ = [
    "BACKENDS", "Backend", "BackendUnavailable", "available_backends", "check_backend_name", "load_backend", "resolve_backend",
]

_MODULES = {
    "torch": "hadw_kernels.backends.torch_backend",
    "triton": "hadw_kernels.backends.triton_backend",
    "cpp": "hadw_kernels.backends.cpp_backend",
}
BACKENDS = tuple(_MODULES)
_PREFERRED = {"cuda": ("triton", "torch"), "cpu": ("cpp", "torch")}
# name -> backend object, or the BackendUnavailable its import raised.
_LOADED: dict[str, Backend | BackendUnavailable] = {}


def _import(name: str) -> Backend | BackendUnavailable:
    try:
        return importlib.import_module(_MODULES[name]).BACKEND
    except ImportError as error:
        return BackendUnavailable(f"backend {name!r} is not available here: {error}")


def check_backend_name(name, key: str = "backend") -> None:
    """``name`` is "auto" or one of BACKENDS (whether it runs here is resolve_backend's)."""
    if name != "auto" and name not in _MODULES:
        raise ValueError(f"unknown {key} {name!r}; expected 'auto' or one of {BACKENDS}")


def load_backend(name: str) -> Backend:
    """The backend object of ``name``; BackendUnavailable if its module cannot load."""
    if name == "auto":
        raise ValueError("load_backend needs a backend's name; 'auto' is resolve_backend's")
    check_backend_name(name)
    if name not in _LOADED:
        _LOADED[name] = _import(name)
    backend = _LOADED[name]
    if isinstance(backend, BackendUnavailable):
        raise BackendUnavailable(*backend.args)
    return backend


def _serving(name: str, device: torch.device):
    try:
        backend = load_backend(name)
    except BackendUnavailable:
        return None
    return backend if backend.serves(device) else None


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can run on tensors of ``device`` here."""
    device = torch.device(device)
    return [name for name in BACKENDS if _serving(name, device) is not None]


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend object for ``name`` ("auto" or one of BACKENDS) on ``device``; a
    named backend that cannot serve the device raises BackendUnavailable saying why."""
    if name == "auto":
        for candidate in _PREFERRED.get(device.type, ("torch",)):
            backend = _serving(candidate, device)
            if backend is not None:
                return backend
        name = "torch"
    backend = load_backend(name)
    if not backend.serves(device):
        raise BackendUnavailable(backend.unavailable_message(device))
    return backend


# Imported now, so that a compiled call finds them loaded (the Triton backend is loaded
# by its first call, or by ``available_backends("cuda")``).
for _name in ("torch", "cpp"):
    _LOADED[_name] = _import(_name)
