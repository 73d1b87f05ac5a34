"""The advantage estimators: each response's baseline b_i, so that A_i = r_i - b_i
(docs/math.md, section 2a).

One row of :data:`ESTIMATORS` per estimator; every caller (``hadw_advantages``, the fused
losses, the trainer, the TRL and verl drop-ins, the bias tool) reads what it needs from
the row. The baselines are written once here, over any grouping of a batch's responses
(a dense group id per response), in the rewards' accumulation dtype;
``reference/estimators.py`` restates them as float64 loops for the tests.
"""

from __future__ import annotations

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


# Where a baseline reads beyond the response's group, as the kernels take it (each an
# index: the Triton and C++ backends' codes are generated from this tuple): "group"
# (nothing), "batch" (the call's or the whole batch's other groups, through their
# BATCH_TOTALS) or "history" (the prompt's pseudo-counts (alpha, beta) across batches).
SCOPES = ("group", "batch", "history")


@dataclass(frozen=True)
class Estimator:
    """One estimator, as every backend forms it (docs/math.md, section 2a): from the
    group's reward sum S and count n, the response's own reward r left out where
    ``leave_one_out`` (S - r over n - 1), the prompt's pseudo-counts added where the
    scope is "history" ((alpha + S - r) / (alpha + beta + n - 1)), and that shrunk by
    the other groups' statistics where it is "batch" (James-Stein)."""

    name: str
    scope: str
    leave_one_out: bool
    # Whether the group's std may divide r - b. Only the group mean's: the estimators that
    # borrow from outside the group give its all-equal groups an advantage, whose std is 0.
    takes_std: bool
    summary: str

    @property
    def group_mean(self) -> bool:
        """Whether the baseline is the group's mean: the hosts' own advantage (TRL's,
        verl's grpo), which they may form themselves."""
        return self.scope == "group" and not self.leave_one_out


def baseline(row: Estimator, values: torch.Tensor, dense: torch.Tensor, stats: GroupStatistics,
             prior: torch.Tensor | None) -> torch.Tensor:
    """b_i [B] of ``row`` from the rewards, each response's group id, the groups'
    statistics and, for the "history" scope, the [B, 2] pseudo-counts (alpha, beta) of
    each response's prompt."""
    sums, counts = stats.sums[dense], stats.counts[dense]
    if row.leave_one_out:
        sums, counts = sums - values, counts - 1
    if row.scope == "history":
        assert prior is not None, "checks.values.check_prior refuses a history estimator without its prior"
        alpha, beta = prior[:, 0].to(values.dtype), prior[:, 1].to(values.dtype)
        sums, counts = alpha + sums, alpha + beta + counts
    own = sums / counts
    if row.scope != "batch":
        return own
    shrinkage, other_mean = james_stein_weights(stats)
    return (1 - shrinkage[dense]) * own + shrinkage[dense] * other_mean[dense]


ESTIMATORS: dict[str, Estimator] = {row.name: row for row in (
    Estimator("grpo", "group", False, True, "the group's mean (GRPO; Dr.GRPO without the std)"),
    Estimator("rloo", "group", True, False, "the mean of the group's other responses (leave-one-out)"),
    Estimator("james_stein", "batch", True, False,
              "the leave-one-out mean shrunk toward the other prompts' mean by the batch's variances (JSPO)"),
    Estimator("prompt_history", "history", True, False,
              "the prompt's discounted Beta posterior, with the group's other responses (SPO/DBB)"),
)}
ESTIMATOR_NAMES = tuple(ESTIMATORS)


def scope_names(scope: str) -> str:
    """The estimators of ``scope`` (one of :data:`SCOPES`) as a refusal names them:
    "'james_stein'", or "'a' or 'b'" once a scope holds two."""
    return " or ".join(repr(name) for name, row in ESTIMATORS.items() if row.scope == scope)


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
