"""A call's options as one ``LossConfig``: the ``config=`` a caller passed, checked once,
or the one built from the option keywords (``config.LossOptions``, the losses' typed
``**options``), built and checked once per distinct set of options; never both. The
losses and the modules' checks at construction (``loss.check_options``) map them here,
in one place."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..tables.bounds import compiling
from .loss_config import LossConfig
from .option_types import LossOptions

# The loss options that only the linear loss takes (it forms the entropy from the logits).
LINEAR_ONLY_OPTIONS = ("entropy_coef",)
OPTION_NAMES = frozenset(LossOptions.__annotations__)


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


def call_config(config: LossConfig | None, options: Mapping[str, Any], *, linear: bool) -> LossConfig:
    """The LossConfig of a call: ``config`` as given, or the preset of ``loss_type`` with
    the option keywords given (not None) overriding it. ``options``: the keywords as the
    caller gave them (a loss's typed ``**options``; a name outside :class:`LossOptions`
    is refused here), not modified."""
    if not options.keys() <= OPTION_NAMES:
        raise TypeError(f"unknown options {sorted(options.keys() - OPTION_NAMES)}; the loss's options are "
                        f"{sorted(OPTION_NAMES)}")
    if config is not None and not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig (LossConfig.build(loss_type, ...)), got {type(config).__name__}")
    for name in () if linear else LINEAR_ONLY_OPTIONS:
        # Refused however it arrives: as a keyword, or held by a config (never dropped).
        if options.get(name) is not None or (config is not None and getattr(config, name)):
            raise TypeError(f"{name} needs the entropy of the token distribution: use fused_linear_hadw_grpo_loss")
    if config is None:
        loss_type = options.get("loss_type") or "grpo"
        fields = {name: value for name, value in options.items() if name != "loss_type"}
        # Keyed by each value's type too: True and 1 are equal but only one is valid.
        return cached_unless_compiling(
            _built_config,
            lambda: (loss_type, tuple((name, type(value), value) for name, value in fields.items())),
            lambda: LossConfig.build(loss_type, **fields))
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        raise TypeError(f"pass the loss's options either as config= or as keywords, not both: got config and {given}")
    if torch.compiler.is_compiling():
        config.validate()
    else:
        config.validated()
    return config


# A call's config is built and checked once per distinct set of options, not on every
# call: that was a quarter of a small call's host time (docs/benchmarks.md, "Host time of
# a small call"). An invalid one raises and is not cached.
@functools.lru_cache(maxsize=256)
def _built_config(key: tuple) -> LossConfig:
    loss_type, items = key
    return LossConfig.build(loss_type, **{name: value for name, _, value in items})
