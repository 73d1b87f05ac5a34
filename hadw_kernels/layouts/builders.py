"""The model-side layouts of a micro-batch: how its prompts and responses are fed to the
model, and how the model's last hidden states reach the loss (docs/layouts.md).

Given each row's prompt and response token ids, a layout (:data:`LAYOUTS`) builds a
:class:`LaidOutBatch`: the model's inputs, the loss's layout (its labels, the mask of the
response tokens and, packed, the segments' offsets ``cu_seqlens``), the map between each
row's response tokens and the loss's positions, and the count of tokens it feeds. It also
counts, without building anything, what a set of rows would feed (:meth:`Layout.tally`),
which is how a trainer cuts micro-batches under a token budget.

- **padded**: prompts left-padded, responses right-padded, one row each [b, P + R];
  every row costs the widest prompt and the widest response.
- **packed**: each row's prompt and response one after another in one row [1, N],
  positions restarting at 0, no padding; the segment attention (``segments.py``) keeps
  each sample to itself.
- **shared_prompt**: packed, each distinct prompt (by its tokens: ``rows.py``) laid out
  once for the responses that follow it, which read it as a prefix: a prompt of P tokens
  with G responses of R costs P - 1 + G R positions instead of G (P + R).

Every layout's positions count a sample's real tokens from 0, as the rollout engine
placed them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch

from ..linear_blocks import IGNORE_INDEX
from .attention import require_segment_attention
from .rows import group_ids, rows_by_group, token_rows
from .segments import Segments


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
        GEMM)."""
        _require_tensor("hidden_states", hidden_states)
        if hidden_states.dim() != 3 or hidden_states.shape[:2] != self.input_ids.shape:
            raise ValueError(f"hidden_states of shape {tuple(hidden_states.shape)}: the model was fed input_ids of "
                             f"shape {tuple(self.input_ids.shape)}, so its last hidden states are "
                             f"{[*self.input_ids.shape, 'H']}")
        if self.is_packed:
            return hidden_states
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
        _require_tensor("values", values)
        rows, longest = len(self.response_lengths), max(self.response_lengths)
        if padded and (values.dim() != 2 or values.shape[0] != rows or values.shape[1] < longest):
            raise ValueError(f"values of shape {tuple(values.shape)}: {rows} rows, the longest response {longest} "
                             f"tokens, take [{rows}, W] right-padded, W >= {longest}")
        if not padded and (values.dim() == 0 or values.shape[0] != rows):
            raise ValueError(f"values of shape {tuple(values.shape)}: {rows} rows take one value a row, [{rows}, ...]")

    def _require_layout(self, values) -> None:
        """``values`` per token in the loss's layout, the labels' shape."""
        _require_tensor("values", values)
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
            _require_tensor(f"per_response[{row}]", row_values)
            if row_values.shape != (length,):
                raise ValueError(f"per_response[{row}] of shape {tuple(row_values.shape)}: row {row}'s response has "
                                 f"{length} tokens")
        values = torch.cat(list(per_response)).to(self.labels.device)
        out = values.new_zeros(self.labels.numel())
        out[self._token_index(self.labels.device)[2]] = values
        return out.view(self.labels.shape)


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} is a {type(value).__name__}, not a tensor")


class TokenTally:
    """The tokens a growing set of rows feeds in a layout, counted from lengths alone:
    ``with_rows`` what it would feed once ``rows`` join, ``add`` them. Rows share a prompt
    where ``groups`` (``rows.prompt_groups``) gives them one id."""

    def __init__(self, prompt_lengths: Sequence[int], response_lengths: Sequence[int], groups: Sequence[int]) -> None:
        if not len(prompt_lengths) == len(response_lengths) == len(groups):
            raise ValueError(f"{len(prompt_lengths)} prompt_lengths, {len(response_lengths)} response_lengths and "
                             f"{len(groups)} groups: one each a row")
        self.prompt_lengths, self.response_lengths, self.groups = prompt_lengths, response_lengths, groups
        self.rows: list[int] = []

    def with_rows(self, rows: Sequence[int]) -> int:
        """The tokens fed once ``rows`` join (without adding them)."""
        return self._with_rows(self._checked(rows))

    def add(self, rows: Sequence[int]) -> None:
        self._add(self._checked(rows))

    def _checked(self, rows: Sequence[int]) -> list[int]:
        """``rows``, each a row of the lengths given; checked as they are counted (a
        trainer asks of a few rows at a time), not all lengths at once."""
        rows, count = list(rows), len(self.prompt_lengths)
        for row in rows:
            if not 0 <= row < count:
                raise ValueError(f"row {row} is not one of the {count} rows the lengths describe")
            if self.prompt_lengths[row] < 1:
                raise ValueError(f"prompt_lengths[{row}] is {self.prompt_lengths[row]}: a sample needs a prompt token")
            if self.response_lengths[row] < 0:
                raise ValueError(f"response_lengths[{row}] is {self.response_lengths[row]}: lengths are non-negative")
        return rows

    def _with_rows(self, rows: Sequence[int]) -> int:
        raise NotImplementedError

    def _add(self, rows: Sequence[int]) -> None:
        self.rows.extend(rows)


class _PaddedTally(TokenTally):
    """Every row padded to the widest prompt and the widest response (at least one
    response position)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.prompt_width = self.response_width = 0

    def _with_rows(self, rows: Sequence[int]) -> int:
        prompt_width = max([self.prompt_width, *(self.prompt_lengths[row] for row in rows)])
        response_width = max([self.response_width, 1, *(self.response_lengths[row] for row in rows)])
        return (len(self.rows) + len(rows)) * (prompt_width + response_width)

    def _add(self, rows: Sequence[int]) -> None:
        super()._add(rows)
        self.prompt_width = max([self.prompt_width, *(self.prompt_lengths[row] for row in rows)])
        self.response_width = max([self.response_width, 1, *(self.response_lengths[row] for row in rows)])


class _PackedTally(TokenTally):
    """Every prompt and response token."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.tokens = 0

    def _tokens(self, rows: Sequence[int]) -> int:
        return sum(self.prompt_lengths[row] + self.response_lengths[row] for row in rows)

    def _with_rows(self, rows: Sequence[int]) -> int:
        return self.tokens + self._tokens(rows)

    def _add(self, rows: Sequence[int]) -> None:
        super()._add(rows)
        self.tokens += self._tokens(rows)


class _SharedPromptTally(TokenTally):
    """Each group's prompt once but its last token (whole where the group's responses
    here are all empty), and every response token."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.response_tokens = 0
        self.prompts: dict[int, tuple[int, bool]] = {}  # group -> (prompt length, a response here has tokens)

    def _merged(self, rows: Sequence[int]) -> dict[int, tuple[int, bool]]:
        prompts = dict(self.prompts)
        for row in rows:
            group = self.groups[row]
            has_tokens = prompts.get(group, (0, False))[1] or self.response_lengths[row] > 0
            prompts[group] = (self.prompt_lengths[row], has_tokens)
        return prompts

    def _with_rows(self, rows: Sequence[int]) -> int:
        prompts = sum(length - has_tokens for length, has_tokens in self._merged(rows).values())
        return self.response_tokens + sum(self.response_lengths[row] for row in rows) + prompts

    def _add(self, rows: Sequence[int]) -> None:
        super()._add(rows)
        self.prompts = self._merged(rows)
        self.response_tokens += sum(self.response_lengths[row] for row in rows)


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
        ``rows.token_rows``). ``pad_token_id``: what fills the padded layout's padding (the
        packed layouts pad nothing). Every prompt needs a token: a response's first token
        is predicted from its prompt's last."""
        prompts, responses = token_rows("prompts", prompts), token_rows("responses", responses)
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        if not prompts:
            raise ValueError("a micro-batch needs at least one row")
        empty = next((row for row, prompt in enumerate(prompts) if not prompt), None)
        if empty is not None:
            raise ValueError(f"prompts[{empty}] is empty: a sample needs a prompt token to predict its response's "
                             "first token from")
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
        return self._build(prompts, responses, pad_token_id, device)

    def _build(self, prompts, responses, pad_token_id, device) -> LaidOutBatch:
        raise NotImplementedError

    def tally(self, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
              groups: Sequence[int] | None = None) -> TokenTally:
        """An empty :class:`TokenTally` over rows of these lengths; ``groups`` (from
        ``rows.prompt_groups``) says which rows share a prompt (None: none do)."""
        if groups is None:
            groups = range(len(prompt_lengths))
        return self._tally(prompt_lengths, response_lengths, groups)

    def fed_tokens(self, rows: Sequence[int], prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                   groups: Sequence[int] | None = None) -> int:
        """Tokens ``rows`` feed the model in this layout, as :meth:`build` lays them out."""
        return self.tally(prompt_lengths, response_lengths, groups).with_rows(rows)

    def __repr__(self) -> str:
        return f"<layout {self.name}>"


class PaddedLayout(Layout):
    name = "padded"
    _tally = _PaddedTally

    def _build(self, prompts, responses, pad_token_id, device) -> LaidOutBatch:
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
    _tally = _PackedTally

    def _build(self, prompts, responses, pad_token_id, device) -> LaidOutBatch:
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
    _tally = _SharedPromptTally

    def _build(self, prompts, responses, pad_token_id, device) -> LaidOutBatch:
        ids: list[int] = []
        positions: list[int] = []
        labels: list[int] = []
        offsets = [0]
        starts = [0] * len(prompts)
        order: list[int] = []
        segments: list[tuple[int, int, int, int]] = []  # (start, length, prefix start, prefix length)
        for rows in rows_by_group(group_ids(prompts)):
            prompt = prompts[rows[0]]
            trunk_start = len(ids)
            trunk = prompt if not any(responses[row] for row in rows) else prompt[:-1]
            ids += trunk
            positions += range(len(trunk))
            labels += [IGNORE_INDEX] * len(trunk)
            if trunk:
                segments.append((trunk_start, len(trunk), 0, 0))
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
                    segments.append((start, len(branch), trunk_start if trunk else 0, len(trunk)))
        in_order = order == list(range(len(prompts)))
        return _packed_batch(ids, positions, labels, offsets, starts, responses, Segments.of(segments),
                             None if in_order else order, device)


def _packed_batch(ids, positions, labels, offsets, starts, responses, segments, segment_rows, device) -> LaidOutBatch:
    label_tensor = _long_tensor(labels)[None]
    return LaidOutBatch(
        _long_tensor(ids)[None].to(device), _long_tensor(positions)[None].to(device),
        None, segments, label_tensor.to(device), (label_tensor != IGNORE_INDEX).to(device),
        torch.tensor(offsets, dtype=torch.int64, device=device), response_starts=starts,
        response_lengths=[len(response) for response in responses], segment_rows=segment_rows,
    )


def _long_tensor(values: list[int]) -> torch.Tensor:
    """``values`` (ints, checked by ``rows.token_rows``) as an int64 tensor, through the
    array module's C loop: torch.tensor reads a list one Python object at a time, the
    larger part of a long row's build."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (PaddedLayout(), PackedLayout(), SharedPromptLayout())}


def get_layout(name: str) -> Layout:
    """The layout named ``name`` (a key of :data:`LAYOUTS`)."""
    if not isinstance(name, str) or name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; the layouts are {sorted(LAYOUTS)}")
    return LAYOUTS[name]
