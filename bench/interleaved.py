"""Timing several implementations against each other on a machine that other work may
share: each runs once to warm up, then in a shuffled order each round, so that a slow
spell of the machine falls on all of them alike; the median of the rounds is reported."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable


def interleaved_times(steps: dict[str, Callable[[], float]], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """name -> the seconds its step returned in each of ``rounds`` rounds (each step times
    what it measures itself), every step once a round in a shuffled order, after one
    warm-up run each."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    order = list(steps)
    shuffle = random.Random(seed)
    for _ in range(rounds):
        shuffle.shuffle(order)
        for name in order:
            times[name].append(steps[name]())
    return times


def interleaved_medians(steps: dict[str, Callable[[], float]], rounds: int, seed: int = 0) -> dict[str, float]:
    """name -> the median over ``rounds`` of the seconds its step returns."""
    return {name: statistics.median(values) for name, values in interleaved_times(steps, rounds, seed).items()}
