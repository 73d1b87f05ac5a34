"""Attention confined to the segments of a packed row, at each segment's own cost.

A packed micro-batch is one row [1, N] holding many samples. transformers confines such a
row with sdpa or eager attention through a dense block-diagonal mask over the whole row,
whose cost is N squared (docs/layouts.md, "The segment attention"). :class:`Segments`
(built by the packed layouts, ``builders.py``, beside the loss's ``cu_seqlens``) attends
within each segment only, so a row costs the sum of its segments' own costs:

- on CUDA in half precision, for segments of many distinct shapes or reading a prefix:
  torch's ``varlen_attn`` (the flash kernel that CUDA torch ships; no flash-attention
  package), one call for the row;
- otherwise scaled-dot-product attention over buckets of segments of equal shape, each
  bucket one batched call: on the CPU, in float32, and for a few shapes without prefixes
  on a GPU, where sdpa's own kernels (cuDNN's on Hopper) beat varlen's.

A segment may read a prefix of keys before its own: each response of a group whose prompt
is laid out once (the shared-prompt layout) reads the prompt's keys and then its own
causally; a node of a prefix tree reads its ancestors' keys, spans scattered over the row
before it (the prefix-tree layout). Its queries are then the suffix of its keys, so its
causal mask is aligned bottom-right (flash's varlen alignment; sdpa's ``is_causal`` aligns
top-left, so the buckets carry an explicit mask).

This module needs torch only; ``attention.py`` hands it to a transformers model.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def _varlen_attention():
    """torch's varlen flash attention and the keywords its version takes for a causal,
    grouped-query call, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in parameters


VARLEN = _varlen_attention()
# Beyond this many buckets of equal-shape segments, one varlen call beats a batched sdpa
# call per bucket on CUDA (each bucket costs its own launches and index copies). A prefix
# needs an explicit mask in sdpa, which leaves its fast kernels: varlen then.
MOST_SDPA_BUCKETS = 4


Span = tuple[int, int]  # (start, length) of a run of positions


@dataclass
class Segments:
    """Segment i's queries are the row's positions ``starts[i] : starts[i] + lengths[i]``;
    its keys are its prefix, the spans ``prefixes[i]`` in order (a shared prompt, a tree
    node's ancestors; none when empty), then its own queries, causally. Every position of
    the row is a query of exactly one segment, and every prefix position comes before the
    segment's queries."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    prefixes: tuple[tuple[Span, ...], ...]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not len(self.starts) == len(self.lengths) == len(self.prefixes):
            raise ValueError("starts, lengths and prefixes need one entry a segment")
        covered = sorted((start, length) for start, length in zip(self.starts, self.lengths) if length)
        position = 0
        for start, length in covered:
            if start != position:
                raise ValueError(f"the segments' queries must tile the row: position {position} is "
                                 f"{'in two segments' if start < position else 'in none'}")
            position += length
        if min(self.lengths, default=0) < 0:
            raise ValueError("segment lengths must be non-negative")
        for index, (spans, start) in enumerate(zip(self.prefixes, self.starts)):
            for prefix, length in spans:
                if length < 0 or not (0 <= prefix and prefix + length <= start):
                    raise ValueError(f"segment {index}'s prefix span {prefix}:{prefix + length} must lie before its "
                                     f"queries (from {start})")

    @classmethod
    def of(cls, segments: list[tuple[int, int, tuple[Span, ...]]]) -> "Segments":
        """From (start, length, prefix spans) a segment."""
        columns = tuple(zip(*segments)) or ((), (), ())
        return cls(columns[0], columns[1], tuple(tuple(spans) for spans in columns[2]))

    @classmethod
    def packed(cls, offsets: list[int]) -> "Segments":
        """Samples one after another, ``offsets`` their boundaries (the loss's cu_seqlens):
        each attends causally within itself."""
        starts = tuple(offsets[:-1])
        lengths = tuple(end - start for start, end in zip(offsets[:-1], offsets[1:]))
        return cls(starts, lengths, ((),) * len(starts))

    @property
    def prefix_lengths(self) -> tuple[int, ...]:
        return tuple(sum(length for _, length in spans) for spans in self.prefixes)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def bucket_count(self) -> int:
        """Distinct (length, prefix length) shapes among the non-empty segments."""
        return len({shape for shape in zip(self.lengths, self.prefix_lengths) if shape[0]})

    @property
    def has_prefixes(self) -> bool:
        return any(self.prefix_lengths)

    def score_count(self) -> int:
        """Query-key pairs the attention forms (the causal half counted whole): the
        sum of each segment's own cost, against N squared for a dense mask."""
        return sum(length * (prefix + length) for length, prefix in zip(self.lengths, self.prefix_lengths))

    # -- the attention ---------------------------------------------------------------

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float | None,
               dropout: float) -> torch.Tensor:
        """query [1, heads, N, d], key and value [1, kv_heads, N, d] (transformers'
        layout) -> [1, N, heads, d]."""
        if query.shape[0] != 1 or query.shape[2] != self.tokens:
            raise ValueError(f"segments of {self.tokens} tokens cannot serve a batch of shape {tuple(query.shape)}: "
                             "a packed row is [1, N]")
        if self._use_varlen(query, dropout):
            return self._varlen(query, key, value, scaling)
        return self._bucketed(query, key, value, scaling, dropout)

    def _use_varlen(self, query: torch.Tensor, dropout: float) -> bool:
        return (VARLEN is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                and dropout == 0.0 and query.shape[-1] <= 256
                and (self.has_prefixes or self.bucket_count > MOST_SDPA_BUCKETS))

    def _device_tensors(self, device: torch.device) -> dict:
        key = ("varlen", device)
        if key not in self._cache:
            lengths = torch.tensor(self.lengths, dtype=torch.int32)
            key_lengths = lengths + torch.tensor(self.prefix_lengths, dtype=torch.int32)
            tensors = {
                "cu_q": torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)).to(device),
                "cu_k": torch.nn.functional.pad(key_lengths.cumsum(0, dtype=torch.int32), (1, 0)).to(device),
                "max_q": max(self.lengths, default=0),
                "max_k": int(key_lengths.max()) if len(self.lengths) else 0,
                "key_index": None,
            }
            if self.has_prefixes:
                # The keys of each segment side by side: its prefix, then its own positions.
                tensors["key_index"] = torch.cat([
                    torch.cat([span_positions(spans), torch.arange(start, start + length)])
                    for start, length, spans in zip(self.starts, self.lengths, self.prefixes)
                ]).to(device)
            self._cache[key] = tensors
        return self._cache[key]

    def _varlen(self, query, key, value, scaling):
        varlen_attn, causal, takes_gqa = VARLEN
        tensors = self._device_tensors(query.device)
        heads, kv_heads = query.shape[1], key.shape[1]
        q = query[0].transpose(0, 1)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        if tensors["key_index"] is not None:
            k, v = k.index_select(0, tensors["key_index"]), v.index_select(0, tensors["key_index"])
        options = dict(causal, scale=scaling)
        if heads != kv_heads:
            if takes_gqa:
                options["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), tensors["cu_q"], tensors["cu_k"],
                          tensors["max_q"], tensors["max_k"], **options)
        return out.unsqueeze(0)

    def _buckets(self, device: torch.device) -> tuple[list, torch.Tensor]:
        """Segments of equal (length, prefix length) batched: (query index [n, length],
        key index [n, prefix + length], causal mask or None for a square one) each, and
        the permutation that puts the buckets' outputs back in row order."""
        key = ("buckets", device)
        if key not in self._cache:
            groups: dict[tuple[int, int], list[int]] = {}
            for index, (length, prefix) in enumerate(zip(self.lengths, self.prefix_lengths)):
                if length:
                    groups.setdefault((length, prefix), []).append(index)
            buckets, order = [], []
            for (length, prefix), members in groups.items():
                own = torch.tensor([self.starts[i] for i in members])[:, None] + torch.arange(length)
                before = torch.stack([span_positions(self.prefixes[i]) for i in members])
                # Query j of a segment reads its whole prefix and its own positions up to j.
                mask = None if not prefix else torch.ones(length, prefix + length, dtype=torch.bool).tril(prefix)
                buckets.append((own.to(device), torch.cat([before, own], dim=1).to(device),
                                None if mask is None else mask.to(device)))
                order.append(own.flatten())
            inverse = torch.empty(self.tokens, dtype=torch.long)
            if order:
                inverse[torch.cat(order)] = torch.arange(self.tokens)
            self._cache[key] = (buckets, inverse.to(device))
        return self._cache[key]

    def _bucketed(self, query, key, value, scaling, dropout):
        buckets, inverse = self._buckets(query.device)
        heads, kv_heads = query.shape[1], key.shape[1]
        parts = []
        for query_index, key_index, mask in buckets:
            # [heads, n, length, d] -> [n, heads, length, d]
            q = query[0][:, query_index].transpose(0, 1)
            k = key[0][:, key_index].transpose(0, 1)
            v = value[0][:, key_index].transpose(0, 1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scaling,
                enable_gqa=heads != kv_heads,
            )
            parts.append(out.transpose(1, 2).reshape(-1, heads, query.shape[-1]))
        if not parts:
            return query.new_zeros(1, 0, heads, query.shape[-1])
        return torch.cat(parts)[inverse].unsqueeze(0)


def span_positions(spans: Sequence[Span]) -> torch.Tensor:
    """The positions of ``spans``, in order."""
    if not spans:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(start, start + length) for start, length in spans])
