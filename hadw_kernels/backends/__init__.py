"""Backend registry: one module per implementation, each with the same two functions.

    surrogate_loss(logprobs, old_logprobs, rewards, response_mask, config, *, anchor,
                   ref_logprobs, importance_weights, entropy) -> (loss, metrics)
    token_logprobs(hidden [N, H], weight [V, H], labels [N], *, lm_head_bias,
                   temperature, ignore_index, with_entropy) -> (logp [N], entropy [N] | None)

"auto" picks the fastest implementation available for the tensors' device.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

BACKENDS = ("torch", "triton", "cpp")

_MODULES = {
    "torch": "hadw_kernels.backends.torch_backend",
    "triton": "hadw_kernels.backends.triton_backend",
    "cpp": "hadw_kernels.backends.cpp_backend",
}


class BackendUnavailable(RuntimeError):
    pass


def load_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected 'auto' or one of {BACKENDS}")
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError as error:
        raise BackendUnavailable(f"backend {name!r} is not available here: {error}") from error
    reason = getattr(module, "unavailable_reason", lambda: None)()
    if reason:
        raise BackendUnavailable(f"backend {name!r} is not available here: {reason}")
    return module


def available_backends() -> list[str]:
    names = []
    for name in BACKENDS:
        try:
            load_backend(name)
        except BackendUnavailable:
            continue
        names.append(name)
    return names


def resolve_backend(name: str, device: torch.device) -> ModuleType:
    """The backend module for ``name`` ("auto" or one of BACKENDS) on ``device``."""
    if name != "auto":
        return load_backend(name)
    preferred = ("triton", "torch") if device.type == "cuda" else ("cpp", "torch")
    for candidate in preferred:
        try:
            return load_backend(candidate)
        except BackendUnavailable:
            continue
    return load_backend("torch")
