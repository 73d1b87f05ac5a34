"""Which checkpoints exist and which are intact, without importing torch: run.py picks
the checkpoint to resume from before the engines (and torch's thread settings) load.

Every completed checkpoint directory holds ``manifest.json``: each file's size and
SHA-256, written after every rank has finished. A file that is missing, shorter than
written (a disk that filled up, a copy cut short) or altered fails the check, and the
error names it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored; the message names the file."""


def completed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in root.iterdir() if (m := STEP_DIR.match(path.name))]
    return sorted(found)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory (``step-<n>``) was saved at."""
    match = STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-<n>)")
    return int(match.group(1))


def latest_checkpoint(root: Path) -> Path | None:
    found = completed_checkpoints(root)
    return found[-1][1] if found else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """Records every file under ``directory`` and fsyncs them all, the manifest last."""
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            files[str(path.relative_to(directory))] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            _fsync(path)
    manifest = directory / MANIFEST
    manifest.write_text(json.dumps(files, indent=1))
    _fsync(manifest)


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def verify_checkpoint(path: Path) -> None:
    """Raises :class:`CheckpointError` naming the first missing, truncated or altered file."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path} is missing (written by an older trainer, or damaged)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{manifest_path} is damaged: {error}") from None
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} is truncated or damaged: {size} bytes, {expected['bytes']} written")
        if file_sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file} is damaged: its SHA-256 differs from the one written")


def select_checkpoint(root: Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint under ``root``, and a warning for each newer damaged
    one. None when there is no checkpoint; an error when none of them is intact."""
    warnings = []
    for _, path in reversed(completed_checkpoints(root)):
        try:
            verify_checkpoint(path)
        except CheckpointError as damage:
            warnings.append(f"skipping checkpoint {path.name}: {damage}")
            continue
        if warnings:
            warnings.append(f"falling back to {path}, the newest intact checkpoint")
        return path, warnings
    if warnings:
        raise CheckpointError("no intact checkpoint to resume from:\n  " + "\n  ".join(warnings))
    return None, warnings


# The Hugging Face export (run.export_hf): the marker the trainer writes into hf_model/,
# a JSON object whose "files" are the names that export wrote, and the names
# save_pretrained and a tokenizer's save_pretrained write, which an export from before
# the marker (or before its list) holds. Anything else in hf_model/ is the user's.
HF_EXPORT_MARKER = ".hadw-trainer-export"
HF_EXPORT_NAMES = re.compile(
    r"^(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab|chat_template)"
    r"\.json$|^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$|^merges\.txt$"
    r"|^tokenizer\.model$|^chat_template\.jinja$"
)


def write_hf_export_marker(directory: Path) -> None:
    """The marker of an export just written to ``directory``, listing its files."""
    files = sorted(entry.name for entry in directory.iterdir())
    marker = {"written_by": "the hadw trainer's HF export (run.export_hf)", "files": files}
    (directory / HF_EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def _hf_export_files(directory: Path) -> set[str]:
    """The names the marker in ``directory`` lists (none for an export before the list)."""
    try:
        marker = json.loads((directory / HF_EXPORT_MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return set()
    files = marker.get("files") if isinstance(marker, dict) else None
    return {name for name in files if isinstance(name, str)} if isinstance(files, list) else set()


def hf_export_foreign_entries(directory: Path) -> list[str]:
    """What in ``directory`` the trainer's HF export did not write (sorted names): empty
    when it does not exist, is empty, or holds a previous export and nothing else. The
    export replaces the whole directory, so anything listed would be deleted; a file the
    user added to an earlier export is listed too."""
    if not directory.exists():
        return []
    if not directory.is_dir():
        return [directory.name]
    written = _hf_export_files(directory) | {HF_EXPORT_MARKER}
    return sorted(entry.name for entry in directory.iterdir()
                  if not (entry.is_file() and (entry.name in written or HF_EXPORT_NAMES.match(entry.name))))
