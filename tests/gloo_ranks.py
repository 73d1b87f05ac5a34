"""Runs a function on two (or more) gloo ranks of a fresh process group on this machine,
for the tests of what the library all-reduces or gathers."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank, world_size, port, function, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = function(rank)
    finally:
        dist.destroy_process_group()


def on_ranks(function, world_size: int = 2) -> dict:
    """``function(rank)``'s result on each rank (``function`` a module-level function)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(world_size, port, function, results), nprocs=world_size, join=True)
    return dict(results)
