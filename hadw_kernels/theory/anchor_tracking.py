"""How closely each anchor rule tracks a moving accuracy: ``python -m
hadw_kernels.theory.anchor_tracking`` prints the table docs/math.md quotes (section 3).

The true accuracy p_t follows a ramp (0.3 to 0.7 over 300 batches) or a step (0.3, then
0.7 from batch 150); each batch draws B binary rewards from it, and the tracking error is
the mean |C_t - p_t| over the batches after the first ``WARMUP`` (20), the same for every
rule, averaged over 3 seeds. C_t is the belief the rule hands the weights (its prior or
its posterior, as labelled). B = 2048 is the paper's batch, B = 64 the trainer's CPU
default. The 10-batch window is the hard rule with h = 10 (the authors' code).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ..advantage.anchor import DifficultyAnchor
from ..tools.cli import summary

STEPS = 300
KINDS = ("ramp", "step")
BATCH_SIZES = (64, 2048)
SEEDS = (0, 1, 2)
WARMUP = 20  # batches left out of the error, for every rule

# label -> a fresh anchor; the soft rule with the library's defaults is the paper's.
RULES: dict[str, Callable[[], DifficultyAnchor]] = {
    "soft (paper, prior)": lambda: DifficultyAnchor("soft"),
    "window h=10 (hard, authors' code, posterior)": DifficultyAnchor.authors_code,
    "kalman IMM (prior)": lambda: DifficultyAnchor("kalman"),
    "kalman IMM (posterior)": lambda: DifficultyAnchor("kalman", belief="posterior"),
}


def accuracy(kind: str, step: int) -> float:
    if kind == "ramp":
        return 0.3 + 0.4 * step / (STEPS - 1)
    if kind == "step":
        return 0.3 if step < STEPS // 2 else 0.7
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def tracking_error(anchor: DifficultyAnchor, kind: str, seed: int, batch: int) -> float:
    """Mean |belief - true accuracy| over the batches after the first ``WARMUP``."""
    generator = torch.Generator().manual_seed(seed)
    errors = []
    for step in range(STEPS):
        truth = accuracy(kind, step)
        belief = anchor.update(torch.bernoulli(torch.full((batch,), truth), generator=generator))
        if step >= WARMUP:
            errors.append(abs(belief - truth))
    return sum(errors) / len(errors)


def table() -> dict[tuple[str, int, str], float]:
    """(rule, batch size, kind) -> tracking error averaged over SEEDS."""
    return {
        (label, batch, kind): sum(tracking_error(make(), kind, seed, batch) for seed in SEEDS) / len(SEEDS)
        for label, make in RULES.items() for batch in BATCH_SIZES for kind in KINDS
    }


def markdown(errors: dict[tuple[str, int, str], float]) -> str:
    columns = [(batch, kind) for batch in BATCH_SIZES for kind in KINDS]
    lines = ["| rule | " + " | ".join(f"B={batch} {kind}" for batch, kind in columns) + " |",
             "| --- |" + " --- |" * len(columns)]
    for label in RULES:
        lines.append(f"| {label} | " + " | ".join(f"{errors[label, b, k]:.4f}" for b, k in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=summary(__doc__)).parse_args()
    print(f"mean |belief - accuracy| after batch {WARMUP}, {len(SEEDS)} seeds, {STEPS} batches")
    print(markdown(table()))


if __name__ == "__main__":
    main()
