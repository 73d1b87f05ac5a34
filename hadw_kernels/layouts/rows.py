"""Which rows of a batch share a prompt: decided by their prompt tokens, not by their order.

Hosts reorder rows before a forward (TRL shuffles a generation batch and splits it into
micro-batches; verl's ``balance_batch`` reorders by length), so a group's responses need
not be contiguous, complete or in any order. Rows whose prompts are the same tokens share
a prompt wherever they fall; two dataset entries with equal prompts share too, which
changes no hidden state.
"""

from __future__ import annotations

from collections.abc import Sequence


def prompt_groups(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Each row's prompt group: rows with equal prompt tokens share an id, the ids
    counting distinct prompts in order of first appearance."""
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(tuple(prompt), len(ids)) for prompt in prompts]


def rows_by_group(groups: Sequence[int]) -> list[list[int]]:
    """The rows of each group (``prompt_groups``' ids), groups in order of first
    appearance, each group's rows in their order."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    return list(members.values())
