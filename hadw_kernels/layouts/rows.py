"""Which rows of a batch share a prompt: decided by their prompt tokens, not by their order.

Hosts reorder rows before a forward (TRL shuffles a generation batch and splits it into
micro-batches; verl's ``balance_batch`` reorders by length), so a group's responses need
not be contiguous, complete or in any order. Rows whose prompts are the same tokens share
a prompt wherever they fall; two dataset entries with equal prompts share too, which
changes no hidden state.

Rows are lists of token ids or 1-D integer tensors (taken as the lists they are); a
tensor of rows is refused, since its padding cannot be told from tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch


def _row_list(name: str, row) -> list:
    """``row`` (``name`` in messages) as a list: a 1-D integer tensor's values, a
    sequence's items."""
    if isinstance(row, torch.Tensor):
        if row.dim() != 1:
            raise TypeError(f"{name} is a {row.dim()}-D tensor: a row is its 1-D token ids")
        if row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
            raise TypeError(f"{name} is a tensor of {row.dtype}: token ids are integers")
        return row.tolist()
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise TypeError(f"{name} is {row!r}, not a sequence of token ids (a list or a 1-D tensor a row)")
    return list(row)


def row_lists(name: str, rows) -> list[list]:
    """``rows`` (the argument ``name``) as a list of lists, each row's items as given."""
    if isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} is a tensor: its rows' padding cannot be told from their tokens; pass each row's "
                        "token ids (a list of lists or of 1-D tensors)")
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"{name} is {rows!r}, not a sequence of rows")
    return [_row_list(f"{name}[{index}]", row) for index, row in enumerate(rows)]


def token_rows(name: str, rows) -> list[list[int]]:
    """``rows`` (the argument ``name``) as lists of token ids, refused unless every id is
    a non-negative int: a float or a bool would be truncated, and -100 is the labels'
    ignore value. One pass over each row (C-level: the types seen, then the least id)."""
    lists = row_lists(name, rows)
    types: set[type] = set()
    for row in lists:
        types.update(map(type, row))
    if any(kind is bool or not issubclass(kind, Integral) for kind in types):
        for index, row in enumerate(lists):
            for column, token in enumerate(row):
                if type(token) is bool or not isinstance(token, Integral):
                    raise TypeError(f"{name}[{index}][{column}] is {token!r} ({type(token).__name__}): token ids "
                                    "are ints")
    if min((min(row) for row in lists if row), default=0) < 0:
        index, row = next((index, row) for index, row in enumerate(lists) if row and min(row) < 0)
        column = next(column for column, token in enumerate(row) if token < 0)
        raise ValueError(f"{name}[{index}][{column}] is {row[column]}: token ids are non-negative (-100 is the "
                         "labels' ignore value)")
    return lists


class RowTokens:
    """A batch's rows as a layout reads them: each row's prompt and response token ids
    (lists of non-negative ints or 1-D integer tensors; checked once, by
    :func:`token_rows`), their lengths, and each row's prompt group
    (:func:`prompt_groups`). What a layout's tally counts and its ``build_rows`` lays
    out; :meth:`subset` takes some of its rows without checking them again."""

    def __init__(self, prompts, responses) -> None:
        prompts, responses = token_rows("prompts", prompts), token_rows("responses", responses)
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        empty = next((row for row, prompt in enumerate(prompts) if not prompt), None)
        if empty is not None:
            raise ValueError(f"prompts[{empty}] is empty: a sample needs a prompt token to predict its response's "
                             "first token from")
        self._hold(prompts, responses, group_ids(prompts))

    def _hold(self, prompts: list[list[int]], responses: list[list[int]], groups: list[int]) -> None:
        self.prompts, self.responses, self.groups = prompts, responses, groups
        self.prompt_lengths = [len(prompt) for prompt in prompts]
        self.response_lengths = [len(response) for response in responses]

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, rows: Sequence[int]) -> "RowTokens":
        """The batch of ``rows``, in their order: the rows as checked here, their prompt
        groups this batch's (any ids serve, equal where prompts are)."""
        subset = RowTokens.__new__(RowTokens)
        subset._hold([self.prompts[row] for row in rows], [self.responses[row] for row in rows],
                     [self.groups[row] for row in rows])
        return subset


def prompt_groups(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Each row's prompt group: rows with equal prompt tokens share an id, the ids
    counting distinct prompts in order of first appearance."""
    return group_ids(row_lists("prompts", prompts))


def group_ids(prompts: list[list[int]]) -> list[int]:
    """``prompt_groups`` of rows already taken as lists (``token_rows``)."""
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(tuple(prompt), len(ids)) for prompt in prompts]


def rows_by_group(groups: Sequence[int]) -> list[list[int]]:
    """The rows of each group (``prompt_groups``' ids), groups in order of first
    appearance, each group's rows in their order."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    return list(members.values())
