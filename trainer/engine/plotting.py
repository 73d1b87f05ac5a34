"""PNG plots of a run's curves, and of several runs side by side (compare.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np

# A mean over seeds and its 95% half-width (tools/intervals.py's mean_interval).
Interval = tuple[float, float]


class SweepSummary(TypedDict):
    """A sweep's figures (compare.py's ``sweep_summary``), per swept value (its text) and
    variant label: what :func:`plot_sweep` draws and compare.py's tables list."""

    values: list[str]
    labels: list[str]
    baseline: str
    keys: list[str]
    means: dict[str, dict[str, dict[str, Interval]]]
    differences: dict[str, dict[str, dict[str, Interval]]]
    next_differences: dict[str, dict[str, dict[str, Interval]]]
    seeds: dict[str, dict[str, int]]
    weighing: dict[str, dict[str, dict[str, Interval]]]


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


def plot_sweep(summary: SweepSummary, key: str, path: Path, title: str) -> None:
    """A sweep's figures (compare.py's ``sweep_summary``): top, each variant's mean over
    seeds at each value with its 95% interval; bottom, each variant minus the baseline at
    the same value (filled) and at the next value (hollow). One column per figure: the
    reward, then each level's training accuracy."""
    values, keys = summary["values"], summary["keys"]
    figure, axes = plt.subplots(2, len(keys), figsize=(4.2 * len(keys), 7.5), squeeze=False)
    positions = np.arange(len(values))
    labels = summary["labels"]
    offsets = np.linspace(-0.12, 0.12, len(labels))
    for column, figure_key in enumerate(keys):
        name = "reward" if figure_key == "reward/mean" else figure_key.split("/", 1)[1]
        top, bottom = axes[0, column], axes[1, column]
        for offset, label in zip(offsets, labels):
            means = np.array([summary["means"][value][label][figure_key] for value in values])
            top.errorbar(positions + offset, means[:, 0], yerr=np.nan_to_num(means[:, 1]), marker="o", capsize=3,
                         label=label)
        for index, label in enumerate(labels[1:], start=1):
            color = f"C{index}"
            same = np.array([summary["differences"][value][label][figure_key] for value in values])
            bottom.errorbar(positions - 0.06, same[:, 0], yerr=np.nan_to_num(same[:, 1]), marker="o", capsize=3,
                            color=color, linestyle="none", label=f"{label} - {summary['baseline']}, same {key}")
            next_rows = [summary["next_differences"][value][label][figure_key] for value in values[:-1]]
            if next_rows:
                following = np.array(next_rows)
                bottom.errorbar(positions[:-1] + 0.06, following[:, 0], yerr=np.nan_to_num(following[:, 1]),
                                marker="o", markerfacecolor="white", capsize=3, color=color, linestyle="none",
                                label=f"{label} - {summary['baseline']} at the next {key}")
        bottom.axhline(0.0, color="grey", linewidth=0.8)
        for axis in (top, bottom):
            axis.set_xticks(positions, [str(value) for value in values])
            axis.set_xlabel(key)
        top.set_title(f"{name}, last fifth of the steps")
        bottom.set_title(f"{name}: difference (95% CI)")
    # One legend below the panels, where it hides no point.
    handles, names = [], []
    for axis in axes[:, 0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.append(handle)
            names.append(label)
    figure.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize=8)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_bias(result: dict, path: Path, title: str) -> None:
    """trainer/tools/bias.py's figures at one checkpoint: per G (rows) and per scale and
    outcome (columns), each estimate's mean error against the true advantage over the
    prompts of each bin of the true accuracy p, with its 95% interval (0: no bias)."""
    sizes = list(result["sizes"])
    columns = [(scale, outcome) for scale in ("centred", "std-normalised") for outcome in ("correct", "wrong")]
    figure, axes = plt.subplots(len(sizes), len(columns), figsize=(4.2 * len(columns), 3.4 * len(sizes)),
                                squeeze=False)
    for row, size in enumerate(sizes):
        bins = result["sizes"][size]["bins"]
        for column, (scale, outcome) in enumerate(columns):
            axis = axes[row, column]
            cells = [(key.split("|", 1)[1], cell[outcome]) for key, cell in bins.items() if key.startswith(scale + "|")]
            for offset, estimate in zip((-0.006, 0.0, 0.006), ("GRPO", "HA-DW", "HA-DW / lambda")):
                points = [(_bin_middle(band) + offset, *cell[estimate]["signed"]) for band, cell in cells
                          if cell["prompts"]]
                if points:
                    x, mean, half = (np.array(values) for values in zip(*points))
                    axis.errorbar(x, mean, yerr=np.nan_to_num(half), marker="o", markersize=3, capsize=2,
                                  label=estimate)
            axis.axhline(0.0, color="grey", linewidth=0.8)
            axis.set_xlim(0, 1)
            axis.set_title(f"G = {size}, {scale}, {outcome} responses", fontsize=9)
            axis.set_xlabel("true accuracy p (reference draws)")
            if column == 0:
                axis.set_ylabel("estimate - true advantage")
            if row == 0 and column == 0:
                axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _bin_middle(band: str) -> float:
    """The middle of a bin written "[0.1, 0.2)"."""
    low, high = (float(edge) for edge in band.strip("[]()").split(","))
    return 0.5 * (low + high)
