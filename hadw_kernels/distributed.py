"""torch.distributed for the library and the trainer: each helper works on one process
alone (no process group, or torch built without distributed) as on one rank of many, so
the code that calls it needs no guard of its own. The gathers and the reduction are
collectives: every rank must call them, in the same order."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether a process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank; 0 alone."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks; 1 alone."""
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_gather_rows(values: torch.Tensor) -> torch.Tensor:
    """Every rank's ``values`` concatenated along dim 0 in rank order; the ranks' row
    counts may differ (the other dims may not)."""
    ranks = world_size()
    if ranks == 1:
        return values
    length = torch.tensor([values.shape[0]], device=values.device)
    lengths = [torch.zeros_like(length) for _ in range(ranks)]
    dist.all_gather(lengths, length)
    counts = [int(count) for count in lengths]
    padded = values.new_zeros((max(counts), *values.shape[1:]))
    padded[: values.shape[0]] = values
    parts = [torch.zeros_like(padded) for _ in range(ranks)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def all_gather_objects(items: list) -> list:
    """Every rank's ``items`` (picklable), concatenated in rank order."""
    ranks = world_size()
    if ranks == 1:
        return list(items)
    parts: list = [None] * ranks
    dist.all_gather_object(parts, list(items))
    return [item for part in parts for item in part]


def all_reduce(values: torch.Tensor, op=None) -> torch.Tensor:
    """``values`` reduced over the ranks by ``op`` (a ``dist.ReduceOp``; None: the sum), in
    a new tensor (``values`` unchanged)."""
    if world_size() == 1:
        return values
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM if op is None else op)
    return values
