"""PNG plots of a run's curves, and of several runs side by side (compare.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np

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


def run_title(config, engine: str) -> str:
    """A run's plot title: its name, loss, anchor, group size and rollout engine (resolved)."""
    algo = config.algorithm
    hadw = f"+HA-DW ({algo.anchor_preset})" if algo.hadw else ""
    return f"{config.run.name}: {algo.loss_type}{hadw}, G={config.rollout.group_size}, engine={engine}"


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


def plot_comparison(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    """``runs`` maps a label to one ``{"metrics": rows, "eval": rows}`` per seed; each
    panel shows the mean over seeds and the min-max band, per label. Panels: the
    training reward, then each level's held-out greedy accuracy where the runs were
    evaluated (eval.jsonl), else each level's training accuracy."""
    seeds = [seed for per_label in runs.values() for seed in per_label]
    evaluated = all(seed["eval"] for seed in seeds)
    source, prefix = ("eval", "eval/") if evaluated else ("metrics", "acc/")
    # In the order the rows list them (the task's, easy to hard), not alphabetical.
    levels = list(dict.fromkeys(k for seed in seeds for row in seed[source] for k in row if k.startswith(prefix)))
    panels = [("metrics", "reward/mean", "training reward (sampled)")]
    panels += [(source, key, f"held-out greedy {key.split('/', 1)[1]}" if evaluated else key) for key in levels]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for axis, (kind, key, name) in zip(axes[0], panels):
        for label, per_seed in runs.items():
            curves = [_series(seed[kind], key) for seed in per_seed]
            length = min(len(steps) for steps, _ in curves)
            if length == 0:
                continue
            window = max(1, length // 15) if kind == "metrics" else 1  # evaluations are few: unsmoothed
            stacked = np.stack([smooth(values[:length], window) for _, values in curves])
            steps = curves[0][0][:length]
            line, = axis.plot(steps, stacked.mean(axis=0), marker="o" if kind == "eval" else None,
                              label=f"{label} (n={len(per_seed)})")
            axis.fill_between(steps, stacked.min(axis=0), stacked.max(axis=0), alpha=0.2, color=line.get_color())
        axis.set_title(name)
        axis.set_xlabel("rollout batch")
        axis.set_ylim(-0.02, 1.02)
        axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
