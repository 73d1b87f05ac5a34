"""The one layout every backend computes on: N tokens in S segments.

A batch reaches the losses in one of two layouts (docs/options.md, "Packed batches"):

- **padded**: per-token tensors [B, T], one response per row, ``response_mask`` marking
  its tokens;
- **packed** (padding-free): per-token tensors [N] (or [1, N], the model's packed output
  as it comes) and ``cu_seqlens`` [S+1], flash-attention's offsets of S segments, one
  response per segment, ``response_mask`` marking which tokens of a segment count (a
  segment may hold its prompt too).

Both become the same thing here: flat per-token tensors [N] and segment offsets
``cu_seqlens`` [S+1] (a padded batch is S = B segments of T tokens, its tensors flattened
without a copy when their rows are contiguous). Per-response tensors (rewards,
advantages, group ids, sequence-level importance weights) are [S]. The reference and
every kernel take this one form, so a feature is written once for both layouts.
"""

from __future__ import annotations

import functools
from typing import overload

import torch


class TokenLayout:
    """S segments over N tokens: ``cu_seqlens`` [S+1] (int64, on the tokens' device), and
    what a padded batch adds: its width T (``padded_width``; None when packed)."""

    def __init__(self, cu_seqlens: torch.Tensor, tokens: int, *, padded_width: int | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
        self.cu_seqlens = cu_seqlens
        self.segments = cu_seqlens.shape[0] - 1
        self.tokens = tokens
        self.padded_width = padded_width
        # The caller's per-token shape ([B, T], [N] or [1, N]): outputs go back to it.
        self.shape = (tokens,) if shape is None else tuple(shape)
        self._token_segment: torch.Tensor | None = None

    @classmethod
    def padded(cls, batch: int, width: int, device: torch.device) -> "TokenLayout":
        """B rows of T tokens. The layout of a shape is formed once and shared by the calls
        of that shape (what it forms later, its token index, is the same for every call):
        its offsets were two of a small call's operators. Under torch.compile it is formed
        in the graph, and under inference mode afresh (an inference tensor kept would be
        refused by a later autograd call)."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return cls._padded(batch, width, device)
        return _padded_layout(batch, width, torch.device(device))

    @classmethod
    def _padded(cls, batch: int, width: int, device: torch.device) -> "TokenLayout":
        cu_seqlens = torch.arange(batch + 1, dtype=torch.int64, device=device) * width
        return cls(cu_seqlens, batch * width, padded_width=width, shape=(batch, width))

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, shape: tuple[int, ...]) -> "TokenLayout":
        tokens = shape[-1] if shape else 0
        return cls(cu_seqlens.to(torch.int64), tokens, shape=shape)

    @property
    def is_packed(self) -> bool:
        return self.padded_width is None

    @overload
    def flat(self, values: torch.Tensor) -> torch.Tensor: ...
    @overload
    def flat(self, values: None) -> None: ...
    @overload
    def flat(self, values: torch.Tensor | None) -> torch.Tensor | None: ...

    def flat(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token tensor in the caller's shape as [N] (a view when it can be)."""
        return None if values is None else values.reshape(self.tokens)

    @overload
    def per_token(self, values: torch.Tensor) -> torch.Tensor: ...
    @overload
    def per_token(self, values: None) -> None: ...
    @overload
    def per_token(self, values: torch.Tensor | None) -> torch.Tensor | None: ...

    def per_token(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """Values per token or per response (importance weights) as [N]: a tensor of one
        value per response ([B], or [S] when packed; a 1-D tensor of length S is read so)
        repeated over its segment's tokens, a per-token one flattened."""
        if values is None:
            return None
        if self.is_per_response(values):
            return self.expand(values)
        return self.flat(values)

    def is_per_response(self, values: torch.Tensor | None) -> bool:
        """Whether ``values`` (per token or per response, as :meth:`per_token` takes them)
        hold one value per response."""
        return values is not None and values.dim() == 1 and values.shape[0] == self.segments

    def flat_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token rows ([B, T, H], [N, H] or [1, N, H]) as [N, H]."""
        return values.reshape(self.tokens, values.shape[-1])

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """A flat per-token output [N] in the caller's shape."""
        return values.view(self.shape)

    @property
    def token_segment(self) -> torch.Tensor:
        """[N] int64: the segment of each token."""
        if self._token_segment is None:
            device = self.cu_seqlens.device
            if self.padded_width is not None:
                self._token_segment = torch.arange(self.segments, device=device).repeat_interleave(self.padded_width)
            else:
                tokens = torch.arange(self.tokens, dtype=torch.int64, device=device)
                self._token_segment = torch.searchsorted(self.cu_seqlens[1:], tokens, right=True)
        return self._token_segment

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        """[S] -> [N]: each token takes its segment's value (a padded batch's by broadcasting
        over its width, without forming each token's segment index). Differentiable: the
        gradient of a segment is the sum of its tokens', formed as :meth:`segment_sum` forms
        a sum (a packed segment's in float64: the gather's own backward adds the tokens one
        after another in their dtype, whose float32 error grows with the segment's length)."""
        if self.padded_width is not None:
            return per_segment[:, None].expand(self.segments, self.padded_width).reshape(self.tokens)
        if per_segment.requires_grad and per_segment.is_floating_point() and per_segment.dtype != torch.float64:
            # The same values (a cast up and back is exact); the backward accumulates in float64.
            return per_segment.to(torch.float64)[self.token_segment].to(per_segment.dtype)
        return per_segment[self.token_segment]

    def segment_sum(self, values: torch.Tensor) -> torch.Tensor:
        """[N] -> [S]: each segment's sum, rounded to the values' dtype, differentiable. A
        padded row sums as eager PyTorch's ``sum`` does (pairwise, in fp32 at least); a
        packed segment's sum adds its tokens one after another (``index_add``), whose
        float32 error grows with the segment's length, so it accumulates in float64: as
        accurate as the row's at any length."""
        if self.padded_width is not None:
            return values.view(self.segments, self.padded_width).sum(dim=-1)
        if values.is_floating_point():
            sums = torch.zeros(self.segments, dtype=torch.float64, device=values.device)
            return sums.index_add(0, self.token_segment, values.to(torch.float64)).to(values.dtype)
        sums = torch.zeros(self.segments, dtype=torch.int64, device=values.device)
        return sums.index_add(0, self.token_segment, values.to(torch.int64))


@functools.lru_cache(maxsize=64)
def _padded_layout(batch: int, width: int, device: torch.device) -> TokenLayout:
    return TokenLayout._padded(batch, width, device)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """The offsets [S+1] (int32, flash-attention's convention) of the sequences packed in
    ``position_ids`` [N] or [1, N], whose positions restart at 0 at each sequence (as
    transformers' ``DataCollatorWithFlattening`` and padding-free trainers give them).

    Positions that do not count up by one within a sample (1, 2, 4 or 0, 2) are refused:
    they are not a packed row's, and offsets read from them would cut other samples.
    Reads the positions on the host (two synchronisations on a GPU): compute the offsets
    once per batch, where the batch is built, not inside a compiled step."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point():
        raise TypeError("position_ids must be an integer tensor [N] or [1, N]")
    if position_ids.dim() not in (1, 2) or (position_ids.dim() == 2 and position_ids.shape[0] != 1):
        raise ValueError(f"position_ids must be [N] or [1, N] (one packed row), got shape {tuple(position_ids.shape)}")
    positions = position_ids.reshape(-1)
    starts = (positions == 0).nonzero().flatten()
    tokens = positions.shape[0]
    if tokens and (starts.numel() == 0 or int(starts[0]) != 0):
        raise ValueError("position_ids must start at 0 (the first sequence's first token)")
    end = torch.full((1,), tokens, dtype=starts.dtype, device=starts.device)
    offsets = torch.cat([starts, end])
    expected = torch.arange(tokens, device=positions.device) - starts.repeat_interleave(offsets.diff())
    wrong = (positions != expected).nonzero().flatten()
    if wrong.numel():
        at = int(wrong[0])
        raise ValueError(
            f"position_ids must count up by one within each sample and restart at 0 at the next: position "
            f"{at} holds {int(positions[at])} where its sample's count gives {int(expected[at])}"
        )
    return offsets.to(torch.int32)
