"""TRL's padded rows and the library's layouts (docs/integrations/trl.md, "Layouts"): each
row's prompt and completion tokens read from TRL's left-padded prompts and right-padded
completions, TRL's per-row tensors placed in a layout, the old and reference log-probs'
forwards cut by group, and a generation batch shuffled by whole groups."""

from __future__ import annotations

import torch

from ..layouts import LaidOutBatch
from ..layouts.rows import prompt_groups, rows_by_group


def in_layout(batch: LaidOutBatch, value):
    """A TRL per-row tensor in ``batch``'s layout: [B] per response in the order of its
    segments, [B, T] per token in its positions; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return batch.per_segment(value) if value.dim() == 1 else batch.from_padded(value)


def token_rows_of(prompt_ids, prompt_mask, completion_ids, completion_mask) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt tokens (TRL left-pads them) and completion tokens (right-padded),
    as lists for a layout: one host read of the ids and masks."""
    return unpadded(prompt_ids, prompt_mask, left=True), unpadded(completion_ids, completion_mask, left=False)


def unpadded(ids, mask, *, left: bool) -> list[list[int]]:
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    kept = positions >= mask.shape[1] - lengths[:, None] if left else positions < lengths[:, None]
    if not torch.equal(mask.bool(), kept):
        raise ValueError(
            "the packed layouts take left-padded prompts and right-padded completions (masks a run of ones beside "
            "the padding); a mask with a gap inside a prompt or completion needs hadw_layout='padded'")
    return [row[len(row) - n:] if left else row[:n] for row, n in zip(ids.tolist(), lengths.tolist())]


def forwards_of(prompts, rows: int) -> list[list[int]]:
    """The rows cut into forwards of ``rows`` rows, as many as TRL's own chunks (under
    ZeRO-3 every rank must run as many forwards), each prompt's rows one after another so
    that a forward holds a group's completions together."""
    ordered = [row for members in rows_by_group(prompt_groups(prompts)) for row in members]
    return [ordered[start:start + rows] for start in range(0, len(ordered), rows)]


def shuffled_by_group(batch: dict) -> dict:
    """TRL's shuffle of a generation batch (every row-wise value permuted in unison) over
    whole groups, rows of equal prompt tokens, instead of single rows: the groups in a
    random order (torch's generator, as TRL's), each group's rows together."""
    groups = rows_by_group(prompt_groups(unpadded(batch["prompt_ids"], batch["prompt_mask"], left=True)))
    permutation = [row for group in torch.randperm(len(groups)).tolist() for row in groups[group]]

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[torch.tensor(permutation, device=value.device)]
        return [value[row] for row in permutation]

    return {key: permute(value) for key, value in batch.items()}
