"""Which layout a host's micro-batches take: :func:`choose_layout`, the one rule behind
the trainer's ``train.layout`` and the TRL drop-in's ``hadw_layout`` (docs/layouts.md,
"Choosing a layout").

A host names a layout of :data:`~.builders.LAYOUTS` or ``"auto"``. A packed layout needs
the segment attention on every model the micro-batches are fed to (the policy, and a
reference model where there is one), which this switches them to. ``auto`` takes the
prefix tree, which feeds no more tokens than any other layout on any batch (a shared run
of tokens is fed once; a row's last token, which predicts nothing, not at all), wherever
the segment attention serves every model, and padded rows where it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .attention import SegmentAttentionUnavailable, disable_segment_attention, own_attention
from .builders import LAYOUTS, Layout
from .switch import enable_segment_attention

AUTO = "auto"
# The layout ``auto`` takes where the segment attention serves the models.
AUTO_PACKED = "prefix_tree"
LAYOUT_CHOICES = (AUTO, *LAYOUTS)


class LayoutChoice(NamedTuple):
    layout: Layout
    reason: str  # why, for a host's log
    # Under ``auto``, the segment attention's refusal where it fell back to padded rows.
    fallback: str | None = None


def check_layout_name(option: str, wanted) -> None:
    """Raises a ValueError naming ``option`` unless ``wanted`` is a layout or ``auto``."""
    if not isinstance(wanted, str) or wanted not in LAYOUT_CHOICES:
        raise ValueError(f"unknown {option} {wanted!r}; choose one of {list(LAYOUT_CHOICES)}")


def choose_layout(models: Sequence[torch.nn.Module], wanted: str, *, option: str,
                  check: bool = True) -> LayoutChoice:
    """The layout ``wanted`` (``option`` names it in messages) on ``models``, which are
    switched to the segment attention for a packed one (``check``: its trial forward,
    skipped where a model cannot run one yet, as under ZeRO-3 before its engine). A packed
    layout asked for by name that the segment attention cannot serve is refused; under
    ``auto`` the models are left on their own attention and fed padded rows."""
    check_layout_name(option, wanted)
    if wanted == "padded":
        return LayoutChoice(LAYOUTS["padded"], f"{option}='padded'")
    original = own_attention(models[0])
    try:
        for model in models:
            enable_segment_attention(model, check=check)
    except SegmentAttentionUnavailable as error:
        for model in models:
            disable_segment_attention(model)
        if wanted != AUTO:
            raise ValueError(f"{option}={wanted!r}: {error}; use {option}='padded' (or 'auto')") from None
        return LayoutChoice(LAYOUTS["padded"], f"the segment attention does not serve this model: {error}", str(error))
    name = AUTO_PACKED if wanted == AUTO else wanted
    return LayoutChoice(LAYOUTS[name], f"{option}={wanted!r}, the segment attention over {original}")
