"""Checkpoints a crash cannot corrupt: model, optimizer, LR schedule (DeepSpeed's own
files), the difficulty anchor, every rank's RNG states and the step.

The trainer draws prompts and sampling seeds from (seed, step, rank), not from a running
generator, so a resumed run samples exactly what an uninterrupted one would; the RNG
states are saved as well for anything that does use the global generators.

A checkpoint is written into ``checkpoints/.partial-<step>``, and only when every rank
has finished writing is it renamed to ``checkpoints/step-<step>`` with ``os.replace``, an
atomic rename. A crash mid-write leaves a ``.partial`` directory that is ignored and
removed by the next save; the newest ``step-*`` directory is always complete.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^step-(\d+)$")
DEEPSPEED_TAG = "state"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def completed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in root.iterdir() if (m := STEP_DIR.match(path.name))]
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = completed_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(root: Path, step: int, engine, anchor, keep: int) -> Path:
    """Collective: every rank calls it. Returns the completed directory."""
    rank = _rank()
    partial = root / f".partial-{step:08d}"
    final = root / f"step-{step:08d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".partial-*"):
            shutil.rmtree(stale)
        partial.mkdir()
    _barrier()
    engine.save_checkpoint(str(partial), tag=DEEPSPEED_TAG, save_latest=False)
    # Each rank's own RNG states and anchor (the anchors agree: their y_t is all-reduced).
    torch.save({"rng": rng_state(), "anchor": anchor.state_dict()}, partial / f"rank{rank}.pt")
    if rank == 0:
        state = {"step": step, "anchor": anchor.state_dict()}
        (partial / "trainer_state.json").write_text(json.dumps(state))
    _barrier()
    if rank == 0:
        _fsync_tree(partial)
        if final.exists():  # the same step saved again (e.g. a resumed run's last step)
            shutil.rmtree(final)
        os.replace(partial, final)
        for _, old in completed_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


def load_checkpoint(path: Path, engine, anchor) -> int:
    """Restores everything into the live objects; returns the step it was saved at."""
    load_path, _ = engine.load_checkpoint(
        str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {path}")
    state = json.loads((path / "trainer_state.json").read_text())
    anchor.load_state_dict(state["anchor"])
    rank_file = path / f"rank{_rank()}.pt"
    if rank_file.exists():  # absent when resuming on more ranks than were saved
        set_rng_state(torch.load(rank_file, weights_only=False)["rng"])
    return int(state["step"])
