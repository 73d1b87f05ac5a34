"""Checkpoints a crash cannot corrupt and a crafted file cannot exploit: model,
optimizer, LR schedule (DeepSpeed's own files), the difficulty anchor, every rank's RNG
states and the step.

The trainer draws prompts and sampling seeds from (seed, step, rank), not from a running
generator, so a resumed run samples exactly what an uninterrupted one would; the RNG
states are saved as well for anything that does use the global generators.

What the trainer writes itself is JSON (``trainer_state.json``, ``rank<r>.json``: the
RNG states as numbers and base64 bytes), never a pickle: loading it runs no code.
DeepSpeed's own files are pickles that DeepSpeed unpickles; a checkpoint directory is
therefore trusted input (docs/trainer.md).

A checkpoint is written into ``checkpoints/.partial-<step>``, its ``manifest.json``
records every file's size and SHA-256, and only when every rank has finished writing is
it renamed to ``checkpoints/step-<step>`` with ``os.replace``, an atomic rename. A crash
mid-write leaves a ``.partial`` directory that is ignored and removed by the next save.
A file damaged afterwards (a disk filled up, a copy cut short) fails the manifest check
of ``checkpoint_files.select_checkpoint``, which names the file and falls back to the
newest intact checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from hadw_kernels import distributed

from ..checkpoint_files import CheckpointError, completed_checkpoints, write_manifest

DEEPSPEED_TAG = "state"
TRAINER_STATE = "trainer_state.json"


def _bytes_to_text(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict:
    """Python's, NumPy's and torch's global generator states as JSON values."""
    version, internal, gauss_next = random.getstate()
    numpy_state = np.random.get_state()
    # A tuple unless np.random.set_bit_generator gave the global RandomState another generator.
    if not isinstance(numpy_state, tuple):
        raise TypeError(f"NumPy's global generator is {numpy_state['bit_generator']}, not MT19937: "
                        "its state cannot be saved in a checkpoint")
    name, keys, position, has_gauss, cached_gaussian = numpy_state
    return {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"name": name, "keys": keys.tolist(), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": _bytes_to_text(torch.get_rng_state()),
        "cuda": [_bytes_to_text(state) for state in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    python, numpy_state = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    np.random.set_state((numpy_state["name"], np.array(numpy_state["keys"], dtype=np.uint32),
                         numpy_state["position"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all([_text_to_bytes(text) for text in state["cuda"]])


def save_checkpoint(root: Path, step: int, engine, anchor, keep: int, history) -> Path:
    """Collective: every rank calls it. Returns the completed directory."""
    rank = distributed.rank()
    partial = root / f".partial-{step:08d}"
    final = root / f"step-{step:08d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".partial-*"):
            shutil.rmtree(stale)
        partial.mkdir()
    distributed.barrier()
    engine.save_checkpoint(str(partial), tag=DEEPSPEED_TAG, save_latest=False)
    # Each rank's own RNG states and anchor (the anchors agree: their y_t is all-reduced).
    rank_state = {"rng": rng_state(), "anchor": anchor.state_dict()}
    (partial / f"rank{rank}.json").write_text(json.dumps(rank_state))
    if rank == 0:
        # The prompts' history is the same on every rank (each folds in the gathered batch).
        state = {"step": step, "anchor": anchor.state_dict(), "history": history.state_dict()}
        (partial / TRAINER_STATE).write_text(json.dumps(state))
    distributed.barrier()
    if rank == 0:
        write_manifest(partial)
        if final.exists():  # the same step saved again (e.g. a resumed run's last step)
            shutil.rmtree(final)
        os.replace(partial, final)
        for _, old in completed_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    distributed.barrier()
    return final


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not the JSON the trainer writes: {error}") from None


def load_checkpoint(path: Path, engine, anchor, history) -> int:
    """Restores everything into the live objects; returns the step it was saved at."""
    state = _read_json(path / TRAINER_STATE)
    rank_file = path / f"rank{distributed.rank()}.json"
    # Absent when resuming on more ranks than were saved: those keep fresh RNG states.
    rank_state = _read_json(rank_file) if rank_file.exists() else None
    try:
        load_path, _ = engine.load_checkpoint(
            str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    except Exception as error:  # DeepSpeed's errors do not say which checkpoint failed
        raise CheckpointError(f"DeepSpeed could not load {path / DEEPSPEED_TAG}: {type(error).__name__}: {error}") from error
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {path / DEEPSPEED_TAG}")
    try:
        anchor.load_state_dict(state["anchor"])
        if "history" in state:
            history.load_state_dict(state["history"])
        else:  # a checkpoint of before the prompts' history
            warnings.warn(f"resuming from {path}, which holds no prompts' history: prompt_history's baselines start "
                          "from the prior again", UserWarning, stacklevel=2)
        if rank_state is not None:
            set_rng_state(rank_state["rng"])
        return int(state["step"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: trainer state does not fit this run: {type(error).__name__}: {error}") from error
