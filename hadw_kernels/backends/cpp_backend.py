"""The "cpp" backend: C++ CPU kernels (csrc/) behind the hadw:: ops.

Importing the compiled module ``hadw_kernels._cpu_kernels`` registers its kernels for
the CPU dispatch key of the ops that ``ops`` defines, so the calls below are ordinary
dispatcher calls: autograd, fake tensors and torch.compile see the same ops as on CUDA.
The module is built by the package install when a C++ compiler and torch are there
(setup.py); otherwise ``unavailable_reason`` says why and "auto" falls back to "torch".
"""

from __future__ import annotations

import importlib

import torch

from .. import ops

__all__ = ["surrogate_loss", "token_logprobs", "unavailable_reason"]

EXTENSION = "hadw_kernels._cpu_kernels"


def _load_extension() -> str | None:
    """Imports the kernels; returns why they cannot be used, or None."""
    try:
        importlib.import_module(EXTENSION)
    except ModuleNotFoundError as error:
        if error.name != EXTENSION:
            raise
        return (
            f"the C++ extension {EXTENSION} is not built (the install found no C++ compiler or no "
            "torch at build time, or compiling failed: see its log, and docs/cpp-backend.md)"
        )
    except ImportError as error:
        return (
            f"the C++ extension {EXTENSION} does not load ({error}); it was probably built against "
            f"another torch than {torch.__version__}: reinstall the package"
        )
    return None


_UNAVAILABLE = _load_extension()


def unavailable_reason() -> str | None:
    return _UNAVAILABLE


def surrogate_loss(logprobs, old_logprobs, rewards, response_mask, config, **tensors):
    return ops.surrogate_loss(logprobs, old_logprobs, rewards, response_mask, config, **tensors)


def token_logprobs(hidden_states, lm_head_weight, labels, **options):
    return ops.token_logprobs(hidden_states, lm_head_weight, labels, **options)
