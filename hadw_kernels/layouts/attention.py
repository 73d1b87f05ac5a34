"""The segment attention on a transformers model: :func:`enable_segment_attention`.

It registers, with transformers' ``AttentionInterface``, an attention function over the
model's own (sdpa, eager, ...) that attends within the segments a packed row comes with
(``segments.Segments``, which the packed layouts build) and hands every other call (padded
batches, generation) to the model's own attention. A packed row that reaches it without
its segments is refused, never attended across samples.

transformers is imported here only when a model is enabled: ``import hadw_kernels`` does
not import it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, cast

import torch

from .segments import Segments

if TYPE_CHECKING:  # for the checker only: importing hadw_kernels does not import transformers
    from transformers import PreTrainedModel

NAME_PREFIX = "hadw_segments_over_"


class SegmentAttentionUnavailable(ValueError):
    """The segment attention cannot serve this model (its message says why)."""


class _PackedRowMarker:
    """What the mask function hands the attention for a packed row (positions restarting,
    no attention mask): the segments must come with the call."""

    def __repr__(self) -> str:
        return "PACKED_ROW"


PACKED_ROW = _PackedRowMarker()

# The position ids last found to count up within their rows: every layer of a forward
# gets the same tensor, so a forward reads them once.
_checked_positions: weakref.ref | None = None
# (the last mask built over a padding mask, which of its queries are real tokens [b, q]):
# the attention gets the mask it was built into, not the padding mask itself.
_real_queries: tuple[weakref.ref, torch.Tensor] | None = None


def _refuse_restarting_positions(position_ids: torch.Tensor | None, query_length: int,
                                 real: torch.Tensor | None) -> None:
    """A forward with a cache (``use_cache`` left at True) skips transformers' packed-row
    detection and builds a plain causal mask: positions that restart within a row then
    mean samples attending to each other. Refused here, one host read a forward (as
    transformers' own detection costs); not under torch.compile, which cannot branch on it.
    Where a padding mask came with the batch, only its ``real`` tokens must count up:
    hosts give padding any position (1 after ``cumsum - 1``, ``masked_fill(1)``; or 0)."""
    global _checked_positions
    if position_ids is None or query_length < 2 or torch.compiler.is_compiling():
        return
    if _checked_positions is not None and _checked_positions() is position_ids:
        return
    if real is None:
        restarts = position_ids[..., 1:] < position_ids[..., :-1]
    else:
        # Below the highest real position before it: a real token that starts a sample.
        highest = torch.where(real, position_ids, -1).cummax(dim=-1).values
        restarts = real[..., 1:] & (position_ids[..., 1:] < highest[..., :-1])
    if bool(restarts.any()):
        raise ValueError(
            "a packed row (positions restarting within a row) reached the segment attention without its segments: "
            "pass attention_segments= (the LaidOutBatch's model_inputs(model)) with the row, or the samples would "
            "attend to each other"
        )
    _checked_positions = weakref.ref(position_ids)


def _remember_real_queries(built, padding_mask: torch.Tensor, q_length: int | None, q_offset) -> None:
    """Which queries of the mask ``built`` over ``padding_mask`` (the batch's 2-D mask,
    one column a token seen) are real tokens, for the attention's check of their
    positions. Left unknown (every position checked) where the queries' columns are not
    plain ints (a static cache's offset is a tensor)."""
    global _real_queries
    _real_queries = None
    if built is None or not isinstance(q_length, int) or not isinstance(q_offset, int):
        return
    if padding_mask.dim() != 2 or padding_mask.shape[-1] < q_offset + q_length:
        return
    try:
        _real_queries = (weakref.ref(built), padding_mask[:, q_offset:q_offset + q_length].bool())
    except TypeError:  # a mask object that takes no weak reference: every position checked
        pass


def _real_queries_of(attention_mask) -> torch.Tensor | None:
    if attention_mask is None or _real_queries is None or _real_queries[0]() is not attention_mask:
        return None
    return _real_queries[1]


def _attention_function(original: str):
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, *, attention_segments: Segments | None = None,
                  dropout: float = 0.0, scaling: float | None = None, sliding_window=None, **kwargs):
        if attention_segments is not None:
            if sliding_window is not None:
                raise ValueError("segment attention does not serve sliding-window layers")
            return attention_segments.attend(query, key, value, scaling=scaling, dropout=dropout), None
        if attention_mask is PACKED_ROW:
            raise ValueError(
                "a packed row (positions restarting, no attention mask) reached the segment attention without "
                "its segments: pass attention_segments= (the LaidOutBatch's model_inputs(model)) with the row, or the "
                "samples would attend to each other"
            )
        _refuse_restarting_positions(kwargs.get("position_ids"), query.shape[2], _real_queries_of(attention_mask))
        return AttentionInterface()[original](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, sliding_window=sliding_window, **kwargs)

    return attention


def _mask_function(original: str):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

    original_mask = ALL_MASK_ATTENTION_FUNCTIONS[original]

    def mask(*args, attention_mask=None, mask_function=None, **kwargs):
        # transformers has found restarting positions and no padding mask (a packed row):
        # the segments come with the call, and the dense mask it would build is never formed.
        if attention_mask is None and mask_function is not None and mask_function is not causal_mask_function:
            return PACKED_ROW
        built = original_mask(*args, attention_mask=attention_mask, mask_function=mask_function, **kwargs)
        if attention_mask is not None:
            _remember_real_queries(built, attention_mask, kwargs.get("q_length"), kwargs.get("q_offset", 0))
        return built

    return mask


def registered_name(model: PreTrainedModel) -> str:
    """The segment attention's name over ``model``'s attention, registered once; raises
    :class:`SegmentAttentionUnavailable` where it cannot serve the model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = model.config
    current = str(config._attn_implementation)
    if current.startswith(NAME_PREFIX):
        return current
    if current not in ALL_MASK_ATTENTION_FUNCTIONS or current not in AttentionInterface():
        raise SegmentAttentionUnavailable(
            f"this model's attention ({current}) is not one the segment attention can wrap: it needs an attention "
            "function in transformers' AttentionInterface and a mask function (sdpa has both)")
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if sliding or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise SegmentAttentionUnavailable(
            f"this model's attention ({current}) has sliding-window layers, which the segment attention does not serve")
    name = NAME_PREFIX + current
    if name not in AttentionInterface():
        AttentionInterface.register(name, _attention_function(current))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _mask_function(current))
    return name


def transformers_model(model: torch.nn.Module) -> PreTrainedModel:
    """``model``, or the model a wrapper (DDP, DeepSpeed, FSDP) holds as ``.module``: the
    first whose config names its attention; a TypeError where there is none."""
    inner: object = model
    while not hasattr(getattr(inner, "config", None), "_attn_implementation"):
        inner = getattr(inner, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(f"model is a {type(model).__name__}: a transformers model (or a wrapper holding one as "
                            ".module) whose config names its attention")
    # A module whose config names its attention, found above: a transformers model, used
    # through PreTrainedModel's interface (its config, set_attn_implementation, ...).
    return cast("PreTrainedModel", inner)


def require_segment_attention(model: torch.nn.Module) -> None:
    """Raises unless ``model`` runs the segment attention (so a packed row's segments are
    honoured, not dropped): a TypeError where it is no transformers model, a ValueError
    naming its attention where that is another."""
    current = transformers_model(model).config._attn_implementation
    if not str(current).startswith(NAME_PREFIX):
        raise ValueError(f"this model's attention ({current}) is not the segment attention, which alone keeps a "
                         "packed row's samples apart: enable_segment_attention(model) first, or lay the rows out "
                         "padded")


def own_attention(model: torch.nn.Module) -> str:
    """The attention implementation of ``model`` beneath the segment attention, if any."""
    return str(transformers_model(model).config._attn_implementation).removeprefix(NAME_PREFIX)


def disable_segment_attention(model: torch.nn.Module) -> None:
    """Puts ``model`` back on its own attention."""
    model = transformers_model(model)
    original = own_attention(model)
    if model.config._attn_implementation != original:
        model.set_attn_implementation(original)
