"""The model's side of a micro-batch: padded, packed, shared-prompt and prefix-tree layouts
of prompt + response token ids (``builders``; what they would feed, ``tallies``), the
rows they read and which share a prompt (``rows``), the segment attention that keeps the
samples of a packed row apart on a transformers model (``segments``, ``attention``;
``switch`` turns a model onto it), and
the rule a host picks a layout by (``choice``). docs/layouts.md."""

from .attention import SegmentAttentionUnavailable, disable_segment_attention
from .builders import LAYOUTS, LaidOutBatch, Layout, get_layout
from .choice import LAYOUT_CHOICES, LayoutChoice, choose_layout
from .rows import RowTokens, prompt_groups, rows_by_group
from .segments import Segments
from .switch import enable_segment_attention
from .tallies import TokenTally

__all__ = [
    "LAYOUTS",
    "LAYOUT_CHOICES",
    "LaidOutBatch",
    "Layout",
    "LayoutChoice",
    "RowTokens",
    "SegmentAttentionUnavailable",
    "Segments",
    "TokenTally",
    "choose_layout",
    "disable_segment_attention",
    "enable_segment_attention",
    "get_layout",
    "prompt_groups",
    "rows_by_group",
]
