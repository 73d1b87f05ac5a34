"""The advantage estimators: each response's baseline b_i, so that A_i = r_i - b_i
(docs/math.md, section 2a).

One row of :data:`ESTIMATORS` per estimator; every caller (``hadw_advantages``, the fused
losses, the trainer, the TRL and verl drop-ins, the bias tool) reads what it needs from
the row. The baselines are written once here, over any grouping of a batch's responses
(a dense group id per response), in the rewards' accumulation dtype;
``reference/estimators.py`` restates them as float64 loops for the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# The sums over a batch's groups that James-Stein reads (docs/math.md, section 2a), in the
# order of batch_totals' [6] tensor: each a plain sum, so ranks or micro-batches add theirs.
BATCH_TOTALS = ("groups", "responses", "rewards", "noise", "means", "squared_means")


@dataclass(frozen=True)
class GroupStatistics:
    """Per group: its response count, reward sum and unbiased reward variance; and
    ``batch``, the whole batch's :data:`BATCH_TOTALS` where the groups are part of a
    larger batch (None: these groups are the batch)."""

    counts: torch.Tensor
    sums: torch.Tensor
    variances: torch.Tensor
    batch: torch.Tensor | None = None

    @classmethod
    def of(cls, values: torch.Tensor, dense: torch.Tensor, groups: int,
           batch: torch.Tensor | None = None) -> "GroupStatistics":
        counts = torch.zeros(groups, dtype=values.dtype, device=values.device).index_add_(
            0, dense, torch.ones_like(values))
        sums = torch.zeros_like(counts).index_add_(0, dense, values)
        centred = values - (sums / counts)[dense]
        squares = torch.zeros_like(counts).index_add_(0, dense, centred.square())
        return cls(counts, sums, squares / (counts - 1), batch)

    def totals(self) -> torch.Tensor:
        """:data:`BATCH_TOTALS` [6] of these groups, in their dtype."""
        means = self.sums / self.counts
        noise = self.variances / (self.counts - 1)
        return torch.stack([self.counts.new_tensor(float(self.counts.numel())), self.counts.sum(), self.sums.sum(),
                            noise.sum(), means.sum(), means.square().sum()])


def _leave_one_out(values: torch.Tensor, dense: torch.Tensor, stats: GroupStatistics) -> torch.Tensor:
    return (stats.sums[dense] - values) / (stats.counts[dense] - 1)


def james_stein_weights(stats: GroupStatistics) -> tuple[torch.Tensor, torch.Tensor]:
    """(lambda_g, m_other_g) per group, each from the batch's other groups alone, so the
    baseline of a response depends on no reward of its own group beyond the leave-one-out
    mean: v is the mean over the other groups of their variance over (n - 1) (the
    sampling variance of a leave-one-out mean), s the variance of their means around
    their mean, lambda = v / (v + s) (0 where both are 0, or with no other group), and
    m_other the mean of the other groups' rewards. The other groups are those of
    ``stats.batch`` where given (the whole batch's totals, these groups among them)."""
    means = stats.sums / stats.counts
    noise = stats.variances / (stats.counts - 1)
    if stats.batch is None and stats.counts.numel() == 1:
        zero = torch.zeros_like(means)
        return zero, zero
    groups, responses, rewards, noises, sums_of_means, squares = (
        stats.totals() if stats.batch is None else stats.batch.to(means.dtype)).unbind()
    others = groups - 1
    other_noise = (noises - noise) / others
    other_mean_of_means = (sums_of_means - means) / others
    other_spread = ((squares - means.square()) / others - other_mean_of_means.square()).clamp_min(0)
    total = other_noise + other_spread
    shrinkage = torch.where(total > 0, other_noise / torch.where(total > 0, total, 1), torch.zeros_like(total))
    other_rewards = (rewards - stats.sums) / (responses - stats.counts)
    return shrinkage, other_rewards


def _group_mean(values, dense, stats, prior):
    return (stats.sums / stats.counts)[dense]


def _rloo(values, dense, stats, prior):
    return _leave_one_out(values, dense, stats)


def _james_stein(values, dense, stats, prior):
    shrinkage, other_mean = james_stein_weights(stats)
    return (1 - shrinkage[dense]) * _leave_one_out(values, dense, stats) + shrinkage[dense] * other_mean[dense]


def _prompt_history(values, dense, stats, prior):
    alpha, beta = prior[:, 0].to(values.dtype), prior[:, 1].to(values.dtype)
    return (alpha + stats.sums[dense] - values) / (alpha + beta + stats.counts[dense] - 1)


@dataclass(frozen=True)
class Estimator:
    name: str
    # What the baseline reads beyond the response's own group: "group" (nothing: the
    # fused surrogate computes it inside its one launch), "batch" (the other groups of the
    # call: one pass over the batch's group statistics before the launch) or "history"
    # (a PromptHistory's pseudo-counts, given by the caller).
    scope: str
    # Whether the group's std may divide r - b. Only the group mean's: the estimators that
    # borrow from outside the group give its all-equal groups an advantage, whose std is 0.
    takes_std: bool
    # Whether the baseline is the group's mean: the fused surrogate forms it inside its one
    # launch, and it is the hosts' own advantage (TRL's, verl's grpo).
    group_mean: bool
    summary: str
    # b_i [B] from the rewards, each response's group id, the groups' statistics and, for
    # "history", the [B, 2] pseudo-counts (alpha, beta) of each response's prompt.
    baseline: Callable[[torch.Tensor, torch.Tensor, "GroupStatistics", torch.Tensor | None], torch.Tensor]


ESTIMATORS: dict[str, Estimator] = {row.name: row for row in (
    Estimator("grpo", "group", True, True, "the group's mean (GRPO; Dr.GRPO without the std)", _group_mean),
    Estimator("rloo", "group", False, False, "the mean of the group's other responses (leave-one-out)", _rloo),
    Estimator("james_stein", "batch", False, False,
              "the leave-one-out mean shrunk toward the other prompts' mean by the batch's variances (JSPO)", _james_stein),
    Estimator("prompt_history", "history", False, False,
              "the prompt's discounted Beta posterior, with the group's other responses (SPO/DBB)", _prompt_history),
)}
ESTIMATOR_NAMES = tuple(ESTIMATORS)


def estimator_row(name: str) -> Estimator:
    if not isinstance(name, str) or name not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {name!r}")
    return ESTIMATORS[name]


def check_std_choice(estimator: Estimator, normalize_std: bool) -> None:
    if normalize_std and not estimator.takes_std:
        raise ValueError(
            f"estimator={estimator.name!r} gives r - b unscaled (docs/math.md, section 2a): normalize_std=True "
            "divides by the group's std, which is 0 for the all-equal groups it gives an advantage; "
            "pass normalize_std=False"
        )
