"""hadw_kernels.distributed, the one home of the library's and the trainer's process-group
helpers: alone they return what one rank holds; on gloo ranks they gather and reduce."""

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import on_ranks

from hadw_kernels import distributed


def test_alone_each_helper_is_this_process_s_own():
    assert not distributed.is_distributed()
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    distributed.barrier()
    values = torch.arange(6.0).view(3, 2)
    assert distributed.all_gather_rows(values) is values
    assert distributed.all_reduce(values) is values
    assert distributed.all_gather_objects((1, "a")) == [1, "a"]


def _helpers_on_rank(rank):
    rows = torch.arange(2.0 * (rank + 1) * 3).view(-1, 3) + 100 * rank  # 2 rows on rank 0, 4 on rank 1
    summed = torch.tensor([1.0 + rank, 5.0])
    distributed.barrier()
    return {
        "ranks": (distributed.is_distributed(), distributed.rank(), distributed.world_size()),
        "rows": distributed.all_gather_rows(rows).tolist(),
        "empty": distributed.all_gather_rows(torch.zeros(0) if rank == 0 else torch.ones(2)).tolist(),
        "objects": distributed.all_gather_objects([rank, f"r{rank}"]),
        "sum": distributed.all_reduce(summed).tolist(),
        "max": distributed.all_reduce(summed, dist.ReduceOp.MAX).tolist(),
        "unchanged": summed.tolist(),
    }


@pytest.mark.slow
def test_on_two_ranks_they_gather_and_reduce_in_rank_order():
    results = on_ranks(_helpers_on_rank)
    assert results[0]["ranks"] == (True, 0, 2) and results[1]["ranks"] == (True, 1, 2)
    rows = torch.arange(6.0).view(-1, 3).tolist() + (torch.arange(12.0).view(-1, 3) + 100).tolist()
    for rank in (0, 1):
        result = results[rank]
        assert result["rows"] == rows
        assert result["empty"] == [1.0, 1.0]
        assert result["objects"] == [0, "r0", 1, "r1"]
        assert result["sum"] == [3.0, 10.0] and result["max"] == [2.0, 5.0]
        assert result["unchanged"] == [1.0 + rank, 5.0]
