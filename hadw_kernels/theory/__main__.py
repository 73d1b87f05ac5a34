"""Reproduce the paper's bias tables and figures: ``python -m hadw_kernels.theory``.

Prints P(G, 0, 0.25), P(G, 0, 0.5) and (G/2) * integral over (0, 2/G) beside the
paper's printed values; draws the bias of the baseline against p (the paper's Figure 2);
runs the binary Monte Carlo through ``group_advantages`` and ``hadw_weights``; and the
truncated-Gaussian case of appendix D. Figures go to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..tools.cli import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    HelpFormatter,
    finite_float,
    int_at_least,
    output_directory,
    summary,
)
from . import paper
from .exact import average_prob_baseline_above, baseline_bias, conditional_advantage, corollary2_average
from .monte_carlo import (
    CorrectResponseAdvantages,
    NonBinaryBaselineBias,
    correct_response_advantages,
    truncated_gaussian_baseline_bias,
)

BIAS_FIGURE_GROUP_SIZES = (2, 4, 8, 16, 32, 128)
NONBINARY_GROUP_SIZES = (4, 8)
MONTE_CARLO_ACCURACIES = np.round(np.arange(0.05, 0.951, 0.05), 2)
# The Gaussian's location runs past [0, 1] so that the truncated mean reaches ~0.09 and
# ~0.91 with the default scale 0.2.
NONBINARY_LOCATIONS = np.linspace(-0.3, 1.3, 33)


def _progress(label: str):
    # Redrawn in place on a terminal; a log file gets only the finished line.
    interactive = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if interactive:
            print(f"\r  {label}: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)
        elif done == total:
            print(f"  {label}: {done}/{total}", file=sys.stderr, flush=True)

    return report


def print_paper_tables() -> None:
    tables = [
        ("P(G, 0, 0.25)", paper.AVERAGE_ABOVE_0_025, lambda g: average_prob_baseline_above(g, 0.0, 0.25)),
        ("P(G, 0, 0.5)", paper.AVERAGE_ABOVE_0_05, lambda g: average_prob_baseline_above(g, 0.0, 0.5)),
        ("(G/2) * int_0^{2/G} P(p_hat > p | S) dp", paper.COROLLARY2_AVERAGE, corollary2_average),
    ]
    for title, printed, exact in tables:
        print(f"\n{title}")
        print(f"  {'G':>3}  {'exact (ours)':>16}  {'paper':>16}  {'ours - paper':>13}")
        for group_size, paper_value in printed.items():
            ours = exact(group_size)
            print(f"  {group_size:>3}  {ours:16.12f}  {paper_value:16.12f}  {ours - paper_value:+13.2e}")


def plot_bias_vs_p(out: Path, pyplot) -> Path:
    p = np.linspace(0.0, 1.0, 2001)[1:-1]
    figure, axes = pyplot.subplots(figsize=(6.4, 4.0))
    for group_size in BIAS_FIGURE_GROUP_SIZES:
        axes.plot(p, baseline_bias(p, group_size), label=f"G = {group_size}")
    axes.axhline(0.0, color="black", linewidth=0.6)
    axes.set_xlabel("accuracy p")
    axes.set_ylabel(r"$E[\hat p \mid S] - p \;=\; E[A - \hat A \mid S]$")
    axes.set_title("Bias of the group baseline given S (binary rewards)")
    axes.legend(ncol=2, fontsize=8)
    return _save(figure, out / "bias_vs_p.png", pyplot)


def print_monte_carlo_table(result: CorrectResponseAdvantages, group_size: int, lambda_scale: float) -> None:
    p = result.accuracy
    exact = conditional_advantage(p, group_size, 1)
    normalised_truth = np.sqrt((1.0 - p) / p)
    print(f"\nCorrect responses of non-degenerate groups, G = {group_size}: mean advantage")
    print("  un-normalised r - p_hat (same scale as the true advantage 1 - p):")
    print(f"  {'p':>5} {'1-p':>7} {'exact':>7} {'GRPO':>7} {'HA-DW':>7} {'HA-DW/λ':>8}"
          f" | {'(1-p)/σ':>8} {'GRPO':>7} {'HA-DW':>7}")
    print(f"  {'':>5} {'':>7} {'':>7} {'':>7} {'':>7} {'':>8} | std-normalised (vs true adv / true std)")
    for i, accuracy in enumerate(p):
        print(
            f"  {accuracy:5.2f} {1 - accuracy:7.4f} {exact[i]:7.4f} {result.mean['raw'][i]:7.4f}"
            f" {result.mean['raw_hadw'][i]:7.4f} {result.mean['raw_hadw'][i] / lambda_scale:8.4f}"
            f" | {normalised_truth[i]:8.4f} {result.mean['std'][i]:7.4f} {result.mean['std_hadw'][i]:7.4f}"
        )
    raw_error = max(float(result.standard_error[name].max()) for name in ("raw", "raw_hadw"))
    std_error = max(float(result.standard_error[name].max()) for name in ("std", "std_hadw"))
    print(f"  largest Monte Carlo standard error: {raw_error:.1e} un-normalised, {std_error:.1e}"
          f" std-normalised; fewest correct responses averaged: {int(result.samples.min())}")


def plot_monte_carlo(
    result: CorrectResponseAdvantages, group_size: int, lambda_scale: float, out: Path, pyplot
) -> Path:
    p = result.accuracy
    fine = np.linspace(0.02, 0.98, 400)
    figure, (raw_axes, std_axes) = pyplot.subplots(1, 2, figsize=(10.0, 4.0))
    raw_axes.plot(fine, 1.0 - fine, color="black", label="true 1 - p")
    raw_axes.plot(fine, conditional_advantage(fine, group_size, 1), color="C0", linewidth=0.8,
                  label=r"exact $E[1-\hat p \mid r=1, S]$")
    raw_axes.plot(p, result.mean["raw"], "o", color="C0", label="GRPO (Monte Carlo)")
    raw_axes.plot(p, result.mean["raw_hadw"], "s", color="C3", label=f"HA-DW, λ = {lambda_scale}")
    raw_axes.plot(p, result.mean["raw_hadw"] / lambda_scale, "^", color="C3", fillstyle="none",
                  label="HA-DW / λ")
    raw_axes.set_title(r"un-normalised $r - \hat p$")
    std_axes.plot(fine, np.sqrt((1.0 - fine) / fine), color="black", label=r"true $(1-p)/\sqrt{p(1-p)}$")
    std_axes.plot(p, result.mean["std"], "o", color="C0", label="GRPO (Monte Carlo)")
    std_axes.plot(p, result.mean["std_hadw"], "s", color="C3", label=f"HA-DW, λ = {lambda_scale}")
    std_axes.set_title("std-normalised (the loss's default)")
    std_axes.set_ylim(0.0, 5.0)
    for axes in (raw_axes, std_axes):
        axes.set_xlabel("accuracy p")
        axes.set_ylabel("mean advantage of correct responses | S")
        axes.legend(fontsize=8)
    figure.suptitle(f"Bernoulli groups, G = {group_size}, anchor 0.5", fontsize=10)
    return _save(figure, out / "monte_carlo_advantage.png", pyplot)


def print_nonbinary_summary(results: dict[tuple[int, float], NonBinaryBaselineBias]) -> None:
    print("\nTruncated Gaussian rewards on [0, 1]: E[p_hat | max - min > σ] - p")
    shown = range(0, len(NONBINARY_LOCATIONS), 4)
    any_result = next(iter(results.values()))
    print(f"  {'G':>2} {'σ':>5} | " + " ".join(f"p={any_result.accuracy[i]:5.3f}" for i in shown))
    for (group_size, threshold), result in results.items():
        print(f"  {group_size:>2} {threshold:5.2f} | " + " ".join(f"{result.bias[i]:+7.4f}" for i in shown))
    largest_error = max(float(r.standard_error.max()) for r in results.values())
    print(f"  largest Monte Carlo standard error: {largest_error:.1e}")


def plot_nonbinary(
    results: dict[tuple[int, float], NonBinaryBaselineBias], reward_scale: float, out: Path, pyplot
) -> Path:
    figure, all_axes = pyplot.subplots(1, len(NONBINARY_GROUP_SIZES), figsize=(10.0, 4.0), sharey=True)
    for axes, group_size in zip(all_axes, NONBINARY_GROUP_SIZES):
        for (size, threshold), result in results.items():
            if size == group_size:
                axes.plot(result.accuracy, result.bias, marker=".", label=f"σ = {threshold}")
        axes.axhline(0.0, color="black", linewidth=0.6)
        axes.set_title(f"G = {group_size}")
        axes.set_xlabel("mean reward p")
        axes.legend(title="update if max - min > σ", fontsize=8)
    all_axes[0].set_ylabel(r"$E[\hat p \mid S_\sigma] - p$")
    figure.suptitle(f"Truncated Gaussian rewards on [0, 1], scale ξ = {reward_scale} (Monte Carlo)",
                    fontsize=10)
    return _save(figure, out / "nonbinary_bias.png", pyplot)


def _save(figure, path: Path, pyplot) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


# Where the figures go by default: the documentation's folder of a source checkout
# (docs/math.md, section 7, shows them), whatever the working directory. An installed package has
# none, and then --out is required.
CHECKOUT_FIGURES = Path(__file__).resolve().parents[2] / "docs" / "figures"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hadw_kernels.theory", description=summary(__doc__),
                                     formatter_class=HelpFormatter)
    checkout = CHECKOUT_FIGURES.is_dir()
    parser.add_argument("--out", type=output_directory, default=CHECKOUT_FIGURES if checkout else None, required=not checkout,
                        help="directory for the PNGs (default: the source checkout's docs/figures)")
    parser.add_argument("--group-size", type=int_at_least(2), default=8, help="G of the binary Monte Carlo")
    parser.add_argument("--groups", type=POSITIVE_INT, default=100_000, help="binary groups per accuracy p")
    parser.add_argument("--anchor", type=finite_float(minimum=0.0, maximum=1.0), default=0.5,
                        help="the difficulty anchor C of the Monte Carlo's Phi")
    parser.add_argument("--lambda-scale", type=POSITIVE_FLOAT, default=1.3, help="Phi's scale lambda")
    parser.add_argument("--nonbinary-groups", type=POSITIVE_INT, default=50_000, help="groups per Gaussian location")
    parser.add_argument("--reward-scale", type=POSITIVE_FLOAT, default=0.2, help="ξ, the Gaussian's scale")
    parser.add_argument("--spread-thresholds", type=NON_NEGATIVE_FLOAT, nargs="+", default=[0.1, 0.2, 0.3],
                        help="σ: a continuous-reward group updates if max - min > σ")
    parser.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="seeds the Monte Carlo")
    args = parser.parse_args(argv)

    # Agg: the command must work on machines without a display.
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    # The tensors are small and the machine may be shared: with more than one intra-op
    # thread, oversubscribed cores made this run many times slower. Restored on exit, as
    # main() may be called in-process.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(args, pyplot)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, pyplot) -> None:
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    print_paper_tables()
    saved = [plot_bias_vs_p(args.out, pyplot)]

    print(f"\nbinary Monte Carlo ({args.groups} groups per p)", file=sys.stderr)
    binary = correct_response_advantages(
        MONTE_CARLO_ACCURACIES, args.group_size, args.groups, anchor=args.anchor,
        lambda_scale=args.lambda_scale, seed=args.seed, progress=_progress("accuracies"),
    )
    print_monte_carlo_table(binary, args.group_size, args.lambda_scale)
    saved.append(plot_monte_carlo(binary, args.group_size, args.lambda_scale, args.out, pyplot))

    print(f"\nnon-binary Monte Carlo ({args.nonbinary_groups} groups per location)", file=sys.stderr)
    nonbinary = {}
    for group_size in NONBINARY_GROUP_SIZES:
        by_threshold = truncated_gaussian_baseline_bias(
            NONBINARY_LOCATIONS, args.reward_scale, group_size, args.spread_thresholds,
            args.nonbinary_groups, seed=args.seed, progress=_progress(f"G = {group_size}"),
        )
        nonbinary.update({(group_size, threshold): result for threshold, result in by_threshold.items()})
    print_nonbinary_summary(nonbinary)
    saved.append(plot_nonbinary(nonbinary, args.reward_scale, args.out, pyplot))

    print("\nsaved " + ", ".join(str(path) for path in saved))
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
