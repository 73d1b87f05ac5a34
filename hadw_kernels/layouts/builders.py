"""The model-side layouts of a micro-batch: how its prompts and responses are fed to the
model, and how the model's last hidden states reach the loss (docs/layouts.md).

Given each row's prompt and response token ids, a layout (:data:`LAYOUTS`) builds a
:class:`LaidOutBatch`: the model's inputs, the loss's layout (its labels, the mask of the
response tokens and, packed, the segments' offsets ``cu_seqlens``), the map between each
row's response tokens and the loss's positions, and the count of tokens it feeds. It also
counts, without building anything, what a set of rows (``rows.RowTokens``) would feed
(:meth:`Layout.tally`), which is how a trainer cuts micro-batches under a token budget.

- **padded**: prompts left-padded, responses right-padded, one row each [b, P + R];
  every row costs the widest prompt and the widest response.
- **packed**: each row's prompt and response one after another in one row [1, N],
  positions restarting at 0, no padding; the segment attention (``segments.py``) keeps
  each sample to itself.
- **shared_prompt**: packed, each distinct prompt (by its tokens: ``rows.py``) laid out
  once for the responses that follow it, which read it as a prefix: a prompt of P tokens
  with G responses of R costs P - 1 + G R positions instead of G (P + R).
- **prefix_tree**: packed, every run of tokens that rows share, at any depth (a system
  prompt common to every prompt, a group's prompt, responses that begin alike), laid out
  once: the model is fed the distinct tokens of the rows (a prefix tree, depth-first),
  each attending to its ancestors and causally to its own node.

Every layout's positions count a sample's real tokens from 0, as the rollout engine
placed them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch

from ..checks.arguments import require_tensor
from ..tables.linear_blocks import IGNORE_INDEX
from .attention import require_segment_attention
from .rows import RowTokens, rows_by_group
from .segments import Segments, Span, span_positions
from .tallies import (
    PackedTally,
    PaddedTally,
    PrefixTreeTally,
    SharedPromptTally,
    TokenTally,
    common_prefix_length,
    fed_sequence,
)


@dataclass
class LaidOutBatch:
    """One micro-batch in a layout. The loss's per-token tensors (``labels``,
    ``response_mask`` and what :meth:`from_padded` and :meth:`from_responses` form) are
    [b, R] padded and [1, N] packed; per-response tensors follow the loss's segments
    (:meth:`per_segment`), which in the shared-prompt layout are grouped by prompt."""

    input_ids: torch.Tensor  # [b, P + R] padded, [1, N] packed
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # padded only
    attention_segments: Segments | None  # packed only
    labels: torch.Tensor  # IGNORE_INDEX where the position predicts no response token
    response_mask: torch.Tensor  # bool, where ``labels`` holds a response token
    cu_seqlens: torch.Tensor | None  # [S+1] int64, packed; None padded
    response_starts: list[int]  # each row's first response position in the loss's flat layout
    response_lengths: list[int]  # each row's response tokens
    segment_rows: list[int] | None = None  # the row of each loss segment, where not the rows' order
    hidden_offset: int = 0  # padded: hidden state hidden_offset + j predicts response token j
    # Packed, where the loss's positions are not the fed positions: the fed position whose
    # hidden state each loss position reads (a position a prefix tree shares is read by
    # every response below it).
    hidden_index: torch.Tensor | None = None
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def fed_tokens(self) -> int:
        """Tokens the model is fed (padding included)."""
        return self.input_ids.numel()

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    def model_inputs(self, model: torch.nn.Module | None = None) -> dict:
        """The inputs of ``model``, the model they are fed to; a packed row's come with its
        segments, which only the segment attention reads
        (``attention.enable_segment_attention``): any other attention ignores them and
        attends across the row's samples, so a packed row needs ``model`` and is refused
        to one not under the segment attention. A padded batch serves any model."""
        if self.attention_segments is None:
            return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids)
        if model is None:
            raise TypeError("model_inputs(model): a packed row's samples are kept apart only by the segment "
                            "attention, so its inputs need the model they are fed to, to check that it runs it")
        require_segment_attention(model)
        return self._packed_inputs()

    def _packed_inputs(self) -> dict:
        return dict(input_ids=self.input_ids, attention_mask=None, position_ids=self.position_ids,
                    attention_segments=self.attention_segments)

    def loss_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The model's last hidden states ([b, P + R, H] or [1, N, H]) that the loss reads,
        in its layout: padded, the [b, R] positions that predict the responses; packed,
        every position (``response_mask`` marks the counted ones, so the prompts' enter no
        GEMM), or in the prefix tree the positions each response reads, gathered (the
        backward adds up the gradients of the responses that share one)."""
        require_tensor("hidden_states", hidden_states)
        if hidden_states.dim() != 3 or hidden_states.shape[:2] != self.input_ids.shape:
            raise ValueError(f"hidden_states of shape {tuple(hidden_states.shape)}: the model was fed input_ids of "
                             f"shape {tuple(self.input_ids.shape)}, so its last hidden states are "
                             f"{[*self.input_ids.shape, 'H']}")
        if self.is_packed:
            return hidden_states if self.hidden_index is None else hidden_states.index_select(1, self.hidden_index)
        width = self.labels.shape[1]
        return hidden_states[:, self.hidden_offset:self.hidden_offset + width]

    def per_segment(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values [b, ...] in the order of the loss's segments (its per-response
        tensors: advantages, rewards, sequence-level weights)."""
        self._require_rows(values)
        if self.segment_rows is None:
            return values
        return values[torch.tensor(self.segment_rows, device=values.device)]

    def _require_rows(self, values, *, padded: bool = False) -> None:
        """``values`` one a row [b, ...], or (``padded``) each row's right-padded [b, W]."""
        require_tensor("values", values)
        rows, longest = len(self.response_lengths), max(self.response_lengths)
        if padded and (values.dim() != 2 or values.shape[0] != rows or values.shape[1] < longest):
            raise ValueError(f"values of shape {tuple(values.shape)}: {rows} rows, the longest response {longest} "
                             f"tokens, take [{rows}, W] right-padded, W >= {longest}")
        if not padded and (values.dim() == 0 or values.shape[0] != rows):
            raise ValueError(f"values of shape {tuple(values.shape)}: {rows} rows take one value a row, [{rows}, ...]")

    def _require_layout(self, values) -> None:
        """``values`` per token in the loss's layout, the labels' shape."""
        require_tensor("values", values)
        if values.shape != self.labels.shape:
            raise ValueError(f"values of shape {tuple(values.shape)}: the loss's layout is "
                             f"{tuple(self.labels.shape)} (the labels')")

    def _token_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, column, loss position) of every response token, rows in order."""
        if device not in self._index:
            rows = torch.repeat_interleave(torch.arange(len(self.response_lengths)),
                                           torch.tensor(self.response_lengths, dtype=torch.long))
            starts = torch.tensor(self.response_starts, dtype=torch.long)
            first = torch.cumsum(torch.tensor([0, *self.response_lengths[:-1]], dtype=torch.long), 0)
            columns = torch.arange(rows.numel()) - first[rows]
            self._index[device] = (rows.to(device), columns.to(device), (starts[rows] + columns).to(device))
        return self._index[device]

    def from_padded(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-token values of the rows' responses, right-padded [b, W] (W at least the
        longest response), in the loss's layout; ``fill`` where no response token is."""
        self._require_rows(values, padded=True)
        rows, columns, positions = self._token_index(values.device)
        out = values.new_full((self.labels.numel(),), fill)
        out[positions] = values[rows, columns]
        return out.view(self.labels.shape)

    def to_padded(self, values: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
        """Per-token values in the loss's layout back as the rows' right-padded [b, width]."""
        self._require_layout(values)
        longest = max(self.response_lengths)
        if type(width) is bool or not isinstance(width, Integral):
            raise TypeError(f"width is {width!r}: an int, at least the longest response ({longest} tokens)")
        if width < longest:
            raise ValueError(f"width {width} is below the longest response ({longest} tokens)")
        rows, columns, positions = self._token_index(values.device)
        out = values.new_full((len(self.response_lengths), width), fill)
        out[rows, columns] = values.reshape(-1)[positions]
        return out

    def per_response(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values in the loss's layout cut into each row's response's."""
        self._require_layout(values)
        flat = values.reshape(-1)
        return [flat[start:start + length] for start, length in zip(self.response_starts, self.response_lengths)]

    def from_responses(self, per_response: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each row's per-token values ([R_i] each, rows in order) placed in the loss's
        layout, zeros elsewhere, in their dtype on the batch's device."""
        if isinstance(per_response, torch.Tensor) or not isinstance(per_response, Sequence):
            raise TypeError(f"per_response is {type(per_response).__name__}: a list of each row's values")
        if len(per_response) != len(self.response_lengths):
            raise ValueError(f"{len(per_response)} responses' values for {len(self.response_lengths)} rows")
        for row, (row_values, length) in enumerate(zip(per_response, self.response_lengths)):
            require_tensor(f"per_response[{row}]", row_values)
            if row_values.shape != (length,):
                raise ValueError(f"per_response[{row}] of shape {tuple(row_values.shape)}: row {row}'s response has "
                                 f"{length} tokens")
        values = torch.cat(list(per_response)).to(self.labels.device)
        out = values.new_zeros(self.labels.numel())
        out[self._token_index(self.labels.device)[2]] = values
        return out.view(self.labels.shape)


class Layout:
    """A layout of :data:`LAYOUTS`. ``packs``: one row [1, N], which needs the segment
    attention. ``shares_prompts``: a prompt is laid out once for its responses in a
    micro-batch, so a trainer keeps a group's rows together where they fit."""

    name: str
    packs: bool = False
    shares_prompts: bool = False
    _tally: type[TokenTally]

    def build(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
              pad_token_id: int | None = None, device: torch.device | str = "cpu") -> LaidOutBatch:
        """The micro-batch of these rows: row i is ``prompts[i]`` followed by
        ``responses[i]`` (token ids: lists of non-negative ints or 1-D integer tensors;
        ``rows.RowTokens``). ``pad_token_id``: what fills the padded layout's padding (the
        packed layouts pad nothing). Every prompt needs a token: a response's first token
        is predicted from its prompt's last."""
        return self.build_rows(RowTokens(prompts, responses), pad_token_id=pad_token_id, device=device)

    def build_rows(self, rows: RowTokens, *, pad_token_id: int | None = None,
                   device: torch.device | str = "cpu") -> LaidOutBatch:
        """:meth:`build` of rows already checked (a ``RowTokens``, or its ``subset``: a
        trainer's micro-batch of the rollout batch it checked once)."""
        if not isinstance(rows, RowTokens):
            raise TypeError(f"rows is a {type(rows).__name__}: build_rows takes a RowTokens (build takes the "
                            "prompts and responses)")
        if not len(rows):
            raise ValueError("a micro-batch needs at least one row")
        if pad_token_id is not None:
            if type(pad_token_id) is bool or not isinstance(pad_token_id, Integral):
                raise TypeError(f"pad_token_id is {pad_token_id!r}: a token id is an int")
            if pad_token_id < 0:
                raise ValueError(f"pad_token_id is {pad_token_id}: token ids are non-negative")
        try:
            device = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device: {error}") from None
        except TypeError:
            raise TypeError(f"device: {device!r} is no device; give a torch.device or its name ('cpu', "
                            "'cuda:0')") from None
        return self._build(rows, pad_token_id, device)

    def _build(self, batch: RowTokens, pad_token_id: int | None, device: torch.device) -> LaidOutBatch:
        raise NotImplementedError

    def tally(self, batch: RowTokens) -> TokenTally:
        """An empty :class:`TokenTally` over the rows of ``batch``."""
        return self._tally(batch)

    def fed_tokens(self, batch: RowTokens, rows: Sequence[int] | None = None) -> int:
        """Tokens ``rows`` of ``batch`` (all of them by default) feed the model in this
        layout, as :meth:`build` lays them out."""
        return self.tally(batch).with_rows(range(len(batch)) if rows is None else rows)

    def __repr__(self) -> str:
        return f"<layout {self.name}>"


class PaddedLayout(Layout):
    name = "padded"
    _tally = PaddedTally

    def _build(self, batch, pad_token_id, device) -> LaidOutBatch:
        prompts, responses = batch.prompts, batch.responses
        if pad_token_id is None:
            raise ValueError("the padded layout needs a pad_token_id")
        prompt_width = max(len(prompt) for prompt in prompts)
        response_width = max(1, max(len(response) for response in responses))
        rows = len(prompts)
        input_ids = torch.full((rows, prompt_width + response_width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        labels = torch.full((rows, response_width), IGNORE_INDEX, dtype=torch.long)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            input_ids[row, prompt_width - len(prompt):prompt_width] = _long_tensor(prompt)
            attention_mask[row, prompt_width - len(prompt):prompt_width + len(response)] = 1
            if response:
                input_ids[row, prompt_width:prompt_width + len(response)] = labels[row, :len(response)] = \
                    _long_tensor(response)
        # Positions count real tokens only, as in the rollout engine (no padding there).
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return LaidOutBatch(
            input_ids.to(device), position_ids.to(device), attention_mask.to(device), None, labels.to(device),
            (labels != IGNORE_INDEX).to(device), None,
            response_starts=[row * response_width for row in range(rows)],
            response_lengths=[len(response) for response in responses], hidden_offset=prompt_width - 1,
        )


class PackedLayout(Layout):
    name = "packed"
    packs = True
    _tally = PackedTally

    def _build(self, batch, pad_token_id, device) -> LaidOutBatch:
        prompts, responses = batch.prompts, batch.responses
        ids: list[int] = []
        positions: list[int] = []
        offsets, starts = [0], []
        for prompt, response in zip(prompts, responses):
            starts.append(len(ids) + len(prompt) - 1)
            ids += prompt + response
            positions += range(len(prompt) + len(response))
            offsets.append(len(ids))
        labels = [IGNORE_INDEX] * len(ids)
        for start, response in zip(starts, responses):
            labels[start:start + len(response)] = response
        return _packed_batch(ids, positions, labels, offsets, starts, responses, Segments.packed(offsets), None,
                             device)


class SharedPromptLayout(Layout):
    """A prompt of P tokens becomes a trunk of its first P - 1 tokens; each response of R
    tokens a branch of R positions: the prompt's last token, then the response's first
    R - 1 tokens, at positions P - 1 onwards. A branch attends to the trunk and causally
    to itself, so position j of it has the hidden state it has in prompt + response and
    predicts response token j. The loss's segments are one a response (its branch; the
    first of a group also holds the trunk, whose positions predict nothing), grouped by
    prompt. A group whose responses are all empty lays out its whole prompt (the row is
    never empty)."""

    name = "shared_prompt"
    packs = True
    shares_prompts = True
    _tally = SharedPromptTally

    def _build(self, batch, pad_token_id, device) -> LaidOutBatch:
        prompts, responses = batch.prompts, batch.responses
        ids: list[int] = []
        positions: list[int] = []
        labels: list[int] = []
        offsets = [0]
        starts = [0] * len(prompts)
        order: list[int] = []
        segments: list[tuple[int, int, tuple[Span, ...]]] = []  # (start, length, prefix spans)
        for rows in rows_by_group(batch.groups):
            prompt = prompts[rows[0]]
            trunk_start = len(ids)
            trunk = prompt if not any(responses[row] for row in rows) else prompt[:-1]
            ids += trunk
            positions += range(len(trunk))
            labels += [IGNORE_INDEX] * len(trunk)
            if trunk:
                segments.append((trunk_start, len(trunk), ()))
            for row in rows:
                response = responses[row]
                start = len(ids)
                branch = (prompt[-1:] + response[:-1]) if response else []
                ids += branch
                positions += range(len(prompt) - 1, len(prompt) - 1 + len(branch))
                labels += response
                starts[row] = start
                offsets.append(len(ids))
                order.append(row)
                if branch:
                    segments.append((start, len(branch), ((trunk_start, len(trunk)),) if trunk else ()))
        in_order = order == list(range(len(prompts)))
        return _packed_batch(ids, positions, labels, offsets, starts, responses, Segments.of(segments),
                             None if in_order else order, device)


class PrefixTreeLayout(Layout):
    """The rows as a prefix tree. A row's fed sequence is its prompt and its response but
    the last token (:func:`fed_sequence`: the positions whose hidden states predict the
    response); sorted, each sequence is laid out after its longest common prefix with the
    one before it, which no earlier sequence exceeds, so every token that rows share is
    fed once and the row holds the sequences' distinct tokens in depth-first order. Each
    sequence's new tokens are one segment, which reads the spans its shared prefix lies
    in (its ancestors) and itself causally, at the positions the tokens have in their own
    rows. The loss's segments are one a response, in the sequences' sorted order,
    gathering the hidden states that predict it (``LaidOutBatch.hidden_index``)."""

    name = "prefix_tree"
    packs = True
    shares_prompts = True
    _tally = PrefixTreeTally

    def _build(self, batch, pad_token_id, device) -> LaidOutBatch:
        prompts, responses = batch.prompts, batch.responses
        sequences = [fed_sequence(prompt, response) for prompt, response in zip(prompts, responses)]
        order = sorted(range(len(sequences)), key=sequences.__getitem__)
        ids: list[int] = []
        positions: list[int] = []
        segments: list[tuple[int, int, tuple[Span, ...]]] = []
        row_spans: list[list[Span]] = [[] for _ in sequences]
        previous: list[int] = []
        previous_spans: list[Span] = []
        for row in order:
            sequence = sequences[row]
            shared = common_prefix_length(previous, sequence)
            spans = _first_positions(previous_spans, shared)
            if shared < len(sequence):
                start, length = len(ids), len(sequence) - shared
                ids += sequence[shared:]
                positions += range(shared, len(sequence))
                segments.append((start, length, tuple(spans)))
                spans.append((start, length))
            row_spans[row] = spans
            previous, previous_spans = sequence, spans
        labels: list[int] = []
        offsets, starts = [0], [0] * len(sequences)
        gathered = []
        for row in order:
            response, first = responses[row], len(prompts[row]) - 1
            starts[row] = len(labels)
            labels += response
            offsets.append(len(labels))
            gathered.append(span_positions(row_spans[row])[first:first + len(response)])
        in_order = order == list(range(len(order)))
        return _packed_batch(ids, positions, labels, offsets, starts, responses, Segments.of(segments),
                             None if in_order else order, device, hidden_index=torch.cat(gathered).to(device))


def _first_positions(spans: list[Span], count: int) -> list[Span]:
    """The spans that hold the first ``count`` positions of ``spans``."""
    kept: list[Span] = []
    for start, length in spans:
        if count <= 0:
            break
        kept.append((start, min(length, count)))
        count -= length
    return kept


def _packed_batch(ids, positions, labels, offsets, starts, responses, segments, segment_rows, device, *,
                  hidden_index: torch.Tensor | None = None) -> LaidOutBatch:
    label_tensor = _long_tensor(labels)[None]
    return LaidOutBatch(
        _long_tensor(ids)[None].to(device), _long_tensor(positions)[None].to(device),
        None, segments, label_tensor.to(device), (label_tensor != IGNORE_INDEX).to(device),
        torch.tensor(offsets, dtype=torch.int64, device=device), response_starts=starts,
        response_lengths=[len(response) for response in responses], segment_rows=segment_rows,
        hidden_index=hidden_index,
    )


def _long_tensor(values: list[int]) -> torch.Tensor:
    """``values`` (ints, checked by ``rows.token_rows``) as an int64 tensor, through the
    array module's C loop: torch.tensor reads a list one Python object at a time, the
    larger part of a long row's build."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (PaddedLayout(), PackedLayout(), SharedPromptLayout(),
                                                                  PrefixTreeLayout())}


def get_layout(name: str) -> Layout:
    """The layout named ``name`` (a key of :data:`LAYOUTS`)."""
    if not isinstance(name, str) or name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; the layouts are {sorted(LAYOUTS)}")
    return LAYOUTS[name]
