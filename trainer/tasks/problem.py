"""What a prompt source hands the trainer: the prompt text, the answer a verifier checks
the response against, and a difficulty label for per-level accuracy curves; and how a
response is scored against that answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# (response text, answer) -> reward
RewardFunction = Callable[[str, str], float]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    level: str


def seeded_rng(seed: int | list[int]) -> np.random.Generator:
    """numpy's generator for ``seed``, which every task draws its problems from.

    numpy is imported here rather than at the top: the task registry loads with the
    config, which run.py imports before it sets the thread count (engine/environment.py)
    that numpy's BLAS reads once, when numpy loads."""
    import numpy as np

    return np.random.default_rng(seed)
