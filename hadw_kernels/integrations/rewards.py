"""What HA-DW asks of a trainer's rewards.

The anchor is a belief about the policy's accuracy and Phi compares each group's mean
reward with it, so both read rewards as accuracies in [0, 1] (the core losses refuse
others under HA-DW, docs/math.md). The integrations check the rewards a trainer hands
them before any of it is folded into the anchor, and say how to fix them: a reward
outside [0, 1] is a scale the user chose (a weighted sum of reward functions, a
-1/+1 verifier), which only the user can map back.
"""

from __future__ import annotations

import torch


def require_unit_interval(rewards: torch.Tensor, fix: str, reader: str = "HA-DW") -> None:
    """Raises ValueError unless every non-NaN reward lies in [0, 1]; ``fix`` says how,
    in the trainer's terms, and ``reader`` names what reads them as accuracies (HA-DW, or
    the prompt history's Beta posterior). NaN marks a response no reward function scored
    (TRL)."""
    scored = rewards[~torch.isnan(rewards)]
    if scored.numel() == 0:
        return
    low, high = scored.min().item(), scored.max().item()
    if not (0.0 <= low and high <= 1.0):
        raise ValueError(
            f"{reader} reads rewards as accuracies in [0, 1], got rewards in [{low:g}, {high:g}]: {fix}. "
            f"Without {reader} any real reward works."
        )
