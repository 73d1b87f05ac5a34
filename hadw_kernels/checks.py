"""Checks of option values, and what becomes of them under torch.compile: a float there
may be symbolic, so value checks do not run while tracing (docs/architecture.md,
"torch.compile"). Read by setup.py without torch: torch is imported when asked.
"""

from __future__ import annotations

import math


def compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def check_finite_positive(name: str, value) -> None:
    """``value`` is a finite positive real (lambda_scale, std_eps, ...): strings, bools,
    NaN and non-positive values raise ValueError naming ``name``. Under torch.compile a
    float argument is symbolic and its value is not checked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    if not compiling() and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")


def cached_unless_compiling(cached, key, direct):
    """``cached(key())``, a call's value formed once per key, or ``direct()`` under
    torch.compile (traced once per graph; Dynamo does not trace the cache) or for a key
    that does not hash (an option of the wrong type, a list say, which ``direct`` then
    refuses by name)."""
    if compiling():
        return direct()
    key = key()
    try:
        hash(key)
    except TypeError:
        return direct()
    return cached(key)
