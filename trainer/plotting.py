"""PNG plots of a run's curves, and of several runs side by side (compare.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PANELS = [
    ("reward", ["reward/mean"]),
    ("accuracy by level", "acc/"),
    ("anchor", ["anchor/y", "anchor/belief"]),
    ("anchor gain eta_t", ["anchor/eta"]),
    ("mean Phi", ["phi_mean"]),
    ("clip fraction", ["clip_frac"]),
    ("entropy", ["entropy_mean"]),
    ("step time split (s)", ["time/rollout", "time/reward", "time/train", "time/sync"]),
]


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    if not points:
        return np.array([]), np.array([])
    steps, values = zip(*points)
    return np.array(steps), np.array(values, dtype=float)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (shorter at the start)."""
    if len(values) == 0 or window <= 1:
        return values
    cumulative = np.concatenate([[0.0], np.cumsum(values)])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(end - window, 0)
    return (cumulative[end] - cumulative[start]) / (end - start)


def plot_run(rows: list[dict], path: Path, title: str) -> None:
    figure, axes = plt.subplots(2, 4, figsize=(18, 8))
    window = max(1, len(rows) // 20)
    for axis, (name, keys) in zip(axes.flat, PANELS):
        if isinstance(keys, str):
            keys = sorted({k for row in rows for k in row if k.startswith(keys)})
        for key in keys:
            steps, values = _series(rows, key)
            if len(steps):
                axis.plot(steps, values, alpha=0.25)
                axis.plot(steps, smooth(values, window), label=key.split("/")[-1], color=axis.lines[-1].get_color())
        axis.set_title(name)
        axis.set_xlabel("rollout batch")
        if len(keys) > 1:
            axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_comparison(runs: dict[str, list[list[dict]]], path: Path, title: str) -> None:
    """``runs`` maps a label to the metric rows of each seed; mean and range per label."""
    levels = sorted({k for seeds in runs.values() for rows in seeds for row in rows for k in row
                     if k.startswith("acc/")})
    keys = ["reward/mean"] + levels
    figure, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for axis, key in zip(axes[0], keys):
        for label, seeds in runs.items():
            curves = [_series(rows, key) for rows in seeds]
            length = min(len(steps) for steps, _ in curves)
            if length == 0:
                continue
            window = max(1, length // 15)
            stacked = np.stack([smooth(values[:length], window) for _, values in curves])
            steps = curves[0][0][:length]
            line, = axis.plot(steps, stacked.mean(axis=0), label=f"{label} (n={len(seeds)})")
            axis.fill_between(steps, stacked.min(axis=0), stacked.max(axis=0), alpha=0.2, color=line.get_color())
        axis.set_title(key)
        axis.set_xlabel("rollout batch")
        axis.set_ylim(-0.02, 1.02)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
