"""Per-step figures: appended to ``metrics.jsonl`` and shown live on a tqdm bar; the
held-out evaluations (``eval.jsonl``) and sample responses (``samples.jsonl``) beside it.

Only rank 0 writes and shows. On resume each file is cut back to the checkpoint's step,
so steps that ran after the last checkpoint of an interrupted run are not listed twice.
A run killed while writing leaves a torn last line (no newline, half a record): it is
dropped on reading, since the step it belonged to runs again after the resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm


def read_metrics(path: Path) -> list[dict]:
    """The rows of a JSONL log; a torn last line is ignored, any other bad line is an error."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    complete, tail = lines[:-1], lines[-1]  # tail: what follows the last newline
    rows = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {number} is not JSON ({error}): {line[:80]!r}") from None
    if tail.strip():
        try:
            rows.append(json.loads(tail))
        except json.JSONDecodeError:
            pass  # torn by a kill mid-write
    return rows


class JsonlLog:
    """Rows appended to a JSONL file, each with a ``step``; rows after ``first_step`` (an
    interrupted run's steps after its last checkpoint) are dropped when it opens."""

    def __init__(self, path: Path, *, first_step: int, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        kept = [row for row in read_metrics(path) if row["step"] <= first_step]
        temporary = path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(temporary, path)
        self.handle = path.open("a")

    def write(self, row: dict) -> None:
        if self.enabled:
            self.handle.write(json.dumps(row) + "\n")
            self.handle.flush()

    def close(self) -> None:
        if self.enabled:
            self.handle.close()


class MetricsLog(JsonlLog):
    def __init__(self, path: Path, *, total_steps: int, first_step: int, enabled: bool, progress: bool) -> None:
        super().__init__(path, first_step=first_step, enabled=enabled)
        self.bar = None
        if enabled and progress:
            self.bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def write(self, row: dict) -> None:
        super().write(row)
        if self.bar is not None:
            self.bar.set_postfix_str(summary(row), refresh=False)
            self.bar.update(1)

    def message(self, text: str) -> None:
        if self.enabled:
            (tqdm.write if self.bar is not None else print)(text)

    def close(self) -> None:
        super().close()
        if self.bar is not None:
            self.bar.close()


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _duration(seconds: float) -> str:
    """Three significant digits, in ms below a second: the layouts' train times on the CPU
    default, all under a second, compare at a glance (tenths of a second showed them equal)."""
    if seconds < 1:
        return f"{seconds * 1000:.3g}ms"
    return f"{seconds:.3g}s" if seconds < 100 else f"{seconds:.0f}s"


def summary(row: dict) -> str:
    """The bar's postfix: the figures that tell at a glance whether training works."""
    levels = " ".join(
        f"{key.split('/', 1)[1]}={_fmt(value)}" for key, value in row.items() if key.startswith("acc/")
    )
    timing = "/".join(_duration(row[f"time/{part}"]) for part in ("rollout", "reward", "train", "sync"))
    skipped = " (no signal: update skipped)" if row.get("update/skipped") else ""
    return (
        f"R={_fmt(row['reward/mean'])} [{levels}] C={_fmt(row['anchor/belief'])} "
        f"eta={_fmt(row['anchor/eta'])} Phi={_fmt(row.get('phi_mean'))} "
        f"clip={_fmt(row.get('clip_frac'), 3)} H={_fmt(row.get('entropy_mean'))} "
        f"tok/s={row['tokens_per_s']:.0f} t(roll/rew/train/sync)={timing}{skipped}"
    )
