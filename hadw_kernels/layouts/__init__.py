"""The model's side of a micro-batch: padded, packed and shared-prompt layouts of prompt +
response token ids (``builders``), which rows share a prompt (``rows``), and the segment
attention that keeps the samples of a packed row apart on a transformers model
(``segments``, ``attention``). docs/layouts.md."""

from .attention import SegmentAttentionUnavailable, disable_segment_attention, enable_segment_attention
from .builders import LAYOUTS, LaidOutBatch, Layout, TokenTally, get_layout
from .rows import prompt_groups, rows_by_group
from .segments import Segments

__all__ = [
    "LAYOUTS",
    "LaidOutBatch",
    "Layout",
    "SegmentAttentionUnavailable",
    "Segments",
    "TokenTally",
    "disable_segment_attention",
    "enable_segment_attention",
    "get_layout",
    "prompt_groups",
    "rows_by_group",
]
