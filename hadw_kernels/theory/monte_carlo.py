"""Monte Carlo checks of the bias, run through the library's own advantage code.

Binary rewards: Bernoulli groups pass through :func:`group_advantages` and
:func:`hadw_weights` exactly as the loss uses them, so the figures measure what training
sees rather than a re-derivation. Non-binary rewards (paper appendix D): truncated
Gaussian scores on [0, 1], where "non-degenerate" has to mean a spread above a threshold,
since continuous rewards are never exactly equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..advantage.group import group_advantages, hadw_weights

Progress = Callable[[int, int], None]

ADVANTAGE_VARIANTS = ("raw", "raw_hadw", "std", "std_hadw")


@dataclass
class CorrectResponseAdvantages:
    """Per accuracy p and per variant in :data:`ADVANTAGE_VARIANTS` (r - p_hat, or
    std-normalised, each without and with the HA-DW weight Phi): mean and standard
    error of the advantage that correct responses of non-degenerate groups receive.

    Incorrect responses need no run of their own: flipping every reward maps p to 1 - p,
    negates the advantages and leaves Phi unchanged when the anchor is 1/2, so their
    mean at p is minus the correct responses' mean at 1 - p.
    """

    accuracy: np.ndarray
    mean: dict[str, np.ndarray]
    standard_error: dict[str, np.ndarray]
    samples: np.ndarray


def correct_response_advantages(
    accuracies: Sequence[float] | np.ndarray,
    group_size: int,
    groups_per_accuracy: int,
    *,
    anchor: float = 0.5,
    lambda_scale: float = 1.3,
    seed: int = 0,
    progress: Progress | None = None,
) -> CorrectResponseAdvantages:
    generator = torch.Generator().manual_seed(seed)
    accuracy = np.asarray(accuracies, dtype=np.float64)
    mean = {name: np.empty(len(accuracy)) for name in ADVANTAGE_VARIANTS}
    standard_error = {name: np.empty(len(accuracy)) for name in ADVANTAGE_VARIANTS}
    samples = np.empty(len(accuracy), dtype=np.int64)
    for index, p in enumerate(accuracy):
        # fp32 0/1 rewards, as a trainer hands them to the loss.
        probabilities = torch.full((groups_per_accuracy * group_size,), float(p))
        rewards = torch.bernoulli(probabilities, generator=generator)
        correct_count = rewards.view(-1, group_size).sum(dim=1)
        nondegenerate = ((correct_count > 0) & (correct_count < group_size)).repeat_interleave(group_size)
        selected = nondegenerate & (rewards == 1)
        weights = hadw_weights(rewards, group_size, anchor, lambda_scale=lambda_scale)
        raw = group_advantages(rewards, group_size, normalize_std=False)
        normalised = group_advantages(rewards, group_size, normalize_std=True)
        variants = {
            "raw": raw,
            "raw_hadw": weights * raw,
            "std": normalised,
            "std_hadw": weights * normalised,
        }
        for name, values in variants.items():
            mean[name][index], standard_error[name][index] = _clustered_mean(values, selected, group_size)
        samples[index] = int(selected.sum())
        if progress is not None:
            progress(index + 1, len(accuracy))
    return CorrectResponseAdvantages(accuracy, mean, standard_error, samples)


def _clustered_mean(values: torch.Tensor, selected: torch.Tensor, group_size: int) -> tuple[float, float]:
    """Mean of ``values`` over ``selected`` and its standard error. The responses of one
    group share their baseline, so they are not independent: the error treats groups as
    the independent units (the ratio estimator's sandwich variance)."""
    weights = selected.view(-1, group_size).double()
    group_sums = (values.view(-1, group_size).double() * weights).sum(dim=1)
    group_counts = weights.sum(dim=1)
    total = group_counts.sum()
    mean = group_sums.sum() / total
    residuals = group_sums - mean * group_counts
    return mean.item(), (residuals.square().sum().sqrt() / total).item()


def _standard_normal_density(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def truncated_gaussian_mean(location: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean of N(location, scale^2) conditioned on [0, 1] (paper appendix D)."""
    lower, upper = (0.0 - location) / scale, (1.0 - location) / scale
    mass = torch.special.ndtr(upper) - torch.special.ndtr(lower)
    return location + scale * (_standard_normal_density(lower) - _standard_normal_density(upper)) / mass


def sample_truncated_gaussian(
    location: float, scale: float, count: int, generator: torch.Generator
) -> torch.Tensor:
    """Inverse-CDF draws of N(location, scale^2) conditioned on [0, 1], in float64."""
    lower = torch.special.ndtr(torch.tensor((0.0 - location) / scale, dtype=torch.float64))
    upper = torch.special.ndtr(torch.tensor((1.0 - location) / scale, dtype=torch.float64))
    uniform = torch.rand(count, dtype=torch.float64, generator=generator)
    draws = location + scale * torch.special.ndtri(lower + (upper - lower) * uniform)
    # ndtri of a quantile within rounding of 0 or 1 can land a hair outside [0, 1].
    return draws.clamp(0.0, 1.0)


@dataclass
class NonBinaryBaselineBias:
    """E[p_hat | S_sigma] - p per mean reward p, with S_sigma = {max r - min r > sigma}."""

    accuracy: np.ndarray
    bias: np.ndarray
    standard_error: np.ndarray
    update_probability: np.ndarray


def truncated_gaussian_baseline_bias(
    locations: Sequence[float] | np.ndarray,
    scale: float,
    group_size: int,
    spread_thresholds: Sequence[float],
    groups_per_location: int,
    *,
    seed: int = 0,
    progress: Progress | None = None,
) -> dict[float, NonBinaryBaselineBias]:
    """One :class:`NonBinaryBaselineBias` per threshold sigma; every threshold is
    measured on the same groups."""
    generator = torch.Generator().manual_seed(seed)
    accuracy = truncated_gaussian_mean(torch.tensor(locations, dtype=torch.float64), scale).numpy()
    results = {
        threshold: NonBinaryBaselineBias(
            accuracy, np.empty(len(accuracy)), np.empty(len(accuracy)), np.empty(len(accuracy))
        )
        for threshold in spread_thresholds
    }
    for index, location in enumerate(locations):
        rewards = sample_truncated_gaussian(location, scale, groups_per_location * group_size, generator)
        grouped = rewards.view(-1, group_size)
        spread = grouped.amax(dim=1) - grouped.amin(dim=1)
        baselines = grouped.mean(dim=1)
        for threshold, result in results.items():
            updates = spread > threshold
            kept = baselines[updates]
            result.bias[index] = kept.mean().item() - accuracy[index]
            result.standard_error[index] = (kept.std() / math.sqrt(kept.numel())).item()
            result.update_probability[index] = updates.double().mean().item()
        if progress is not None:
            progress(index + 1, len(locations))
    return results
