"""Group-relative advantages and the HA-DW weights Phi (docs/math.md, sections 2 and 4).

Plain PyTorch: this is the reference that every kernel's advantage is tested against,
and the building block for users who wire their own loss.

:func:`hadw_advantages` is the rollout-time form a trainer such as TRL or verl needs:
A_hat * Phi for a whole rollout batch, its groups given by contiguity or by an index
(verl's ``uid``), computed once and then passed to the losses as ``advantages=`` so
micro-batches may split and shuffle the rows freely.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, overload

import torch

from .. import distributed
from ..checks.values import check_advantage_options, check_prior, check_prior_values
from ..config.loss_config import DEFAULT_LAMBDA_SCALE, DEFAULT_STD_EPS, LossConfig
from ..tables.estimators import ESTIMATORS, GroupStatistics, baseline, check_std_choice, estimator_row
from ..tables.precision import accumulate_dtype

if TYPE_CHECKING:
    from ..batch.inputs import SurrogateBatch


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of length {rewards.numel()} do not split into groups of {group_size}"
        )
    # Advantages are at least fp32: bf16 rewards would round k/G.
    dtype = accumulate_dtype(rewards.dtype)
    return rewards.detach().to(dtype).view(-1, group_size)


def all_equal_groups(rewards: torch.Tensor, group_size: int | None = None, *, dense: torch.Tensor | None = None,
                     groups: int | None = None) -> torch.Tensor:
    """[groups] bool: whether each group's rewards are all equal, the groups the in-group
    baselines give exactly 0 and ``zero_std_frac`` counts. Groups are contiguous runs of
    ``group_size`` rewards [B], or ``dense`` [B] holds each reward's group in
    0..groups-1. Tested by min == max, not by std == 0: the mean of equal non-dyadic
    rewards is not always bit-equal to them (docs/math.md, section 2). A group holding a
    NaN is not equal. No host read."""
    rewards = rewards.detach().to(accumulate_dtype(rewards.dtype))  # exact: equal stays equal
    if dense is None:
        if group_size is None:
            raise ValueError("all_equal_groups takes group_size (contiguous groups) or dense and groups")
        groups = rewards.numel() // group_size
        dense = torch.arange(rewards.numel(), device=rewards.device) // group_size
    elif groups is None:
        raise ValueError("all_equal_groups takes groups with dense: the number of groups dense labels")
    lowest = torch.full((groups,), math.inf, dtype=rewards.dtype, device=rewards.device)
    highest = torch.full_like(lowest, -math.inf)
    return lowest.scatter_reduce_(0, dense, rewards, "amin") == highest.scatter_reduce_(0, dense, rewards, "amax")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    std_eps: float = DEFAULT_STD_EPS,
) -> torch.Tensor:
    """A_hat_i = (r_i - mean_g) / (std_g + std_eps), or r_i - mean_g without the std.

    ``rewards`` is [B] with each group's ``group_size`` responses contiguous. The std is
    unbiased (as ``torch.std``). A group whose rewards are all equal gets exactly 0.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and grouped.numel():
        centred = centred / (grouped.std(dim=1, keepdim=True) + std_eps)
    equal = all_equal_groups(grouped.reshape(-1), group_size)
    centred = torch.where(equal[:, None], torch.zeros_like(centred), centred)
    return centred.reshape(-1)


def _anchor_operand(anchor: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """The anchor as an operand of ``like``'s arithmetic, in its dtype, without a copy to
    its device: a Python number or a 0-d CPU tensor enters as a scalar (a blocking copy
    to a GPU would wait for all the work queued there). Detached: it is data, which
    nothing here differentiates through (docs/math.md)."""
    if not isinstance(anchor, torch.Tensor):
        return float(anchor)
    if anchor.dim() != 0:
        raise ValueError(f"anchor must be a scalar, got shape {tuple(anchor.shape)}")
    anchor = anchor.detach()
    return anchor if anchor.device.type == "cpu" else anchor.to(like.dtype)


def hadw_weights(
    rewards: torch.Tensor,
    group_size: int,
    anchor: float | torch.Tensor,
    *,
    lambda_scale: float = DEFAULT_LAMBDA_SCALE,
) -> torch.Tensor:
    """Phi_i = lambda_scale * exp(D_i * M_g), with D_i = -sgn(A_hat_i) sgn(p_hat_g - C)
    and M_g = |p_hat_g - C|.

    ``anchor`` is the belief C (a float or a 0-d tensor, e.g. from
    :meth:`DifficultyAnchor.update`). Phi depends on A_hat only through its sign, which
    the std normalisation does not change, so it is the same for every loss type.
    The result carries no gradient.
    """
    grouped = _grouped(rewards, group_size)
    group_mean = grouped.mean(dim=1, keepdim=True)
    advantage_sign = torch.sign(grouped - group_mean)
    equal = all_equal_groups(grouped.reshape(-1), group_size)
    advantage_sign = torch.where(equal[:, None], torch.zeros_like(advantage_sign), advantage_sign)
    difficulty = group_mean - _anchor_operand(anchor, grouped)
    exponent = -advantage_sign * torch.sign(difficulty) * difficulty.abs()
    return (lambda_scale * torch.exp(exponent)).reshape(-1)


def _contiguous_index(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(dense group id [B] in 0..groups-1, groups) for any labels (verl's uids)."""
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D [B], got shape {tuple(group_index.shape)}")
    if group_index.is_floating_point() or group_index.is_complex():
        raise TypeError(f"group_index must hold integers, got {group_index.dtype}")
    unique, dense = torch.unique(group_index, return_inverse=True)
    return dense, unique.numel()


# The return's type follows return_phi (the trainer and the integrations read one or both).
@overload
def hadw_advantages(rewards: torch.Tensor, *, group_size: int | None = ...,
                    group_index: torch.Tensor | Sequence[int] | None = ..., anchor: float | torch.Tensor | None = ...,
                    lambda_scale: float = ..., normalize_std: bool | None = ..., std_eps: float = ...,
                    estimator: str = ..., prior: torch.Tensor | None = ...,
                    return_phi: Literal[False] = ...) -> torch.Tensor: ...
@overload
def hadw_advantages(rewards: torch.Tensor, *, group_size: int | None = ...,
                    group_index: torch.Tensor | Sequence[int] | None = ..., anchor: float | torch.Tensor | None = ...,
                    lambda_scale: float = ..., normalize_std: bool | None = ..., std_eps: float = ...,
                    estimator: str = ..., prior: torch.Tensor | None = ...,
                    return_phi: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...


def hadw_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_index: torch.Tensor | Sequence[int] | None = None,
    anchor: float | torch.Tensor | None = None,
    lambda_scale: float = DEFAULT_LAMBDA_SCALE,
    normalize_std: bool | None = None,
    std_eps: float = DEFAULT_STD_EPS,
    estimator: str = "grpo",
    prior: torch.Tensor | None = None,
    return_phi: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A * Phi [B] for a whole rollout batch, to pass to the losses as ``advantages``.

    Groups are either contiguous runs of ``group_size`` rows, or the rows sharing a
    value of ``group_index`` [B] (integers, any order, groups of any size >= 2; verl's
    ``uid`` mapped to integers; a tensor, or a list or numpy array taken to rewards'
    device). ``estimator`` names the baseline b_i of A_i = r_i - b_i (docs/math.md,
    section 2a): "grpo" (the group's mean; divided by the group's std unless
    ``normalize_std=False``, Dr.GRPO), "rloo", "james_stein" (reads the batch's other
    groups) or "prompt_history" (reads ``prior``, the [B, 2] pseudo-counts
    :meth:`PromptHistory.update` returns). ``normalize_std=None`` takes the estimator's
    own (True for "grpo" only). ``anchor=None`` gives no Phi. Under "grpo" a group whose
    rewards are all equal gets exactly 0; the others may give it an advantage. Float
    rewards in, at least fp32 out; no gradient. The inputs are refused as the fused loss
    refuses them: an anchor outside [0, 1] or not finite, lambda_scale or std_eps not
    finite and positive, NaN or inf rewards, and rewards outside [0, 1] with an anchor
    or a prior. ``return_phi=True`` returns (A * Phi, Phi), Phi [B] the weights as they
    were multiplied in (1 without an anchor, lambda_scale where A is 0), for a caller that
    reports them (docs/math.md, section 4).
    """
    if (group_size is None) == (group_index is None):
        raise ValueError("pass exactly one of group_size (contiguous groups) and group_index")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise TypeError(f"group_size must be an int, got {group_size!r}")
    if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
        raise TypeError("rewards must be a floating-point tensor")
    row = estimator_row(estimator)
    normalize_std = row.takes_std if normalize_std is None else normalize_std
    check_std_choice(row, normalize_std)
    check_advantage_options(rewards, anchor, lambda_scale, std_eps)
    check_prior(row.scope, row.name, prior, rewards)
    if group_size is not None and row.group_mean:
        both = _group_mean_advantages(rewards, group_size, normalize_std, std_eps, anchor, lambda_scale)
        return both if return_phi else both[0]
    values, dense, groups = _labelled(rewards, group_size, group_index)
    if prior is not None:
        check_prior_values(prior, values, dense, groups)
    both = estimated_advantages(values, dense, groups, row, normalize_std, std_eps, anchor, lambda_scale, prior)
    return both if return_phi else both[0]


def _group_mean_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool, std_eps: float, anchor,
                           lambda_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A * Phi, Phi) [B] of checked rewards in contiguous groups under the group mean's
    baseline, by the kernels' own reference (group_advantages, hadw_weights). No host
    read."""
    advantage_hat = group_advantages(rewards, group_size, normalize_std=normalize_std, std_eps=std_eps)
    if anchor is None:
        return advantage_hat, torch.ones_like(advantage_hat)
    phi = hadw_weights(rewards, group_size, anchor, lambda_scale=lambda_scale)
    return advantage_hat * phi, phi


def _labelled(rewards: torch.Tensor, group_size: int | None,
              group_index) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rewards as values, dense group id [B], groups) of checked groups: contiguous runs of
    ``group_size`` (their checks are ``_grouped``'s), or ``group_index``'s labels."""
    if group_size is None:
        return _indexed(rewards, group_index)
    grouped = _grouped(rewards, group_size)
    return grouped.reshape(-1), torch.arange(rewards.numel(), device=rewards.device) // group_size, grouped.shape[0]


def _indexed(rewards: torch.Tensor, group_index) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rewards in their accumulation dtype, dense group id [B], groups) of checked
    ``group_index`` labels."""
    if not isinstance(group_index, torch.Tensor):
        try:  # a list or a numpy array of ids: on rewards' device, as a tensor would be
            group_index = torch.as_tensor(group_index, device=rewards.device)
        except (TypeError, ValueError, RuntimeError) as error:
            message = f"group_index must be integer ids (a tensor, list or array), got {group_index!r:.80}"
            raise TypeError(message) from error
    if group_index.shape != rewards.shape:
        raise ValueError(f"group_index has shape {tuple(group_index.shape)}, rewards {tuple(rewards.shape)}")
    if group_index.device != rewards.device:
        raise ValueError(f"group_index is on {group_index.device}, rewards on {rewards.device}")
    values = rewards.detach().to(accumulate_dtype(rewards.dtype))
    dense, groups = _contiguous_index(group_index)
    counts = torch.zeros(groups, dtype=values.dtype, device=values.device).index_add_(0, dense, torch.ones_like(values))
    if bool((counts < 2).any()):
        raise ValueError("every group of group_index needs at least 2 responses (a group-relative baseline)")
    return values, dense, groups


def batch_totals(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_index: torch.Tensor | Sequence[int] | None = None,
    all_reduce: bool = False,
) -> torch.Tensor:
    """The sums over a rollout batch's groups that ``james_stein`` reads (float64 [6],
    ``estimators.BATCH_TOTALS``; docs/math.md, section 2a), for a fused loss's
    ``batch_totals=``: a call that holds part of the batch (a micro-batch, one rank's
    share) then shrinks each of its groups toward the whole batch's other groups, as
    ``hadw_advantages`` over the whole batch does. Groups as in ``hadw_advantages``;
    ``all_reduce=True`` sums every rank's totals (each rank's groups whole, its own), so
    every rank holds the whole batch's."""
    if (group_size is None) == (group_index is None):
        raise ValueError("pass exactly one of group_size (contiguous groups) and group_index")
    if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
        raise TypeError("rewards must be a floating-point tensor")
    check_advantage_options(rewards, None, DEFAULT_LAMBDA_SCALE, DEFAULT_STD_EPS)
    values, dense, groups = _labelled(rewards, group_size, group_index)
    totals = GroupStatistics.of(values.to(torch.float64), dense, groups).totals()
    if all_reduce and distributed.is_distributed():
        if torch.distributed.get_backend() == "nccl":
            totals = totals.to(torch.device("cuda", torch.cuda.current_device()))
        totals = distributed.all_reduce(totals).to(rewards.device)
    return totals


def estimated_advantages(values: torch.Tensor, dense: torch.Tensor, groups: int, row, normalize_std: bool,
                         std_eps: float, anchor, lambda_scale: float, prior: torch.Tensor | None,
                         totals: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A * Phi, Phi) [B] of checked inputs: ``values`` the rewards in their accumulation
    dtype, ``dense`` each one's group id in 0..groups-1, ``totals`` the whole batch's
    (``batch_totals``; None: these groups are the batch); Phi is 1 without an anchor, and
    lambda where A is 0 (as hadw_weights gives it). No host read: the fused losses call it
    on the batch validation returned."""
    stats = GroupStatistics.of(values, dense, groups, totals)
    advantage = values - baseline(row, values, dense, stats, prior)
    if normalize_std:
        advantage = advantage / (stats.variances.sqrt()[dense] + std_eps)
    if row.scope == "group":  # in-group baselines give equal rewards exactly 0 (a mean of them may round)
        equal = all_equal_groups(values, dense=dense, groups=groups)
        advantage = torch.where(equal[dense], torch.zeros_like(advantage), advantage)
    if anchor is None:
        return advantage, torch.ones_like(advantage)
    difficulty = (stats.sums / stats.counts)[dense] - _anchor_operand(anchor, values)
    phi = lambda_scale * torch.exp(-torch.sign(advantage) * torch.sign(difficulty) * difficulty.abs())
    return advantage * phi, phi


def weighted_advantages(
    rewards: torch.Tensor | None,
    advantages: torch.Tensor | None,
    config: LossConfig,
    anchor: float | torch.Tensor | None,
    totals: torch.Tensor | None = None,
    prior: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A, Phi [S] or None): the caller's advantages (as given: per token [N] or per
    response [S]), or A * Phi [S] from rewards by ``config.advantage_estimator``, over the
    batch whose ``totals`` are given (None: the call's groups are the batch), with each
    response's ``prior`` pseudo-counts [S, 2] for the history's estimator."""
    if advantages is not None:
        return advantages.detach().to(accumulate_dtype(advantages.dtype)), None
    if rewards is None:  # validation passes exactly one of them (check_batch_inputs)
        raise ValueError("pass exactly one of rewards and advantages")
    return reward_advantages(rewards, config, anchor, totals, prior)


def reward_advantages(rewards: torch.Tensor, config: LossConfig, anchor: float | torch.Tensor | None,
                      totals: torch.Tensor | None = None,
                      prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A * Phi, Phi) [S] from ``rewards`` by ``config.advantage_estimator``
    (:func:`weighted_advantages` of a call with rewards), over the batch whose ``totals``
    are given, with ``prior`` for the history's estimator: the reference every backend's
    in-kernel advantage is tested against."""
    group_size = config.reward_group_size()
    rewards = rewards.detach()
    row = ESTIMATORS[config.advantage_estimator]
    if not row.group_mean:
        values = rewards.to(accumulate_dtype(rewards.dtype))
        dense = torch.arange(values.numel(), device=values.device) // group_size
        return estimated_advantages(values, dense, values.numel() // group_size, row, config.normalize_std,
                                    config.std_eps, anchor, config.lambda_scale, prior, totals)
    return _group_mean_advantages(rewards, group_size, config.normalize_std, config.std_eps, anchor,
                                  config.lambda_scale)


def call_advantages(batch: SurrogateBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A call's advantages, detached: each token's [N]; each response's [S] (None where
    the caller's are per token); and Phi [S] (None unless formed from rewards)."""
    if batch.advantages is not None:
        return weighted_advantages(None, batch.advantages, batch.config, None)[0], None, None
    response, phi = weighted_advantages(batch.rewards, batch.response_advantages, batch.config, batch.anchor,
                                        batch.batch_totals, batch.prior)
    return batch.layout.expand(response), response, phi


def group_metrics(rewards: torch.Tensor, phi: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """phi_mean and zero_std_frac (groups whose rewards are all equal)."""
    degenerate = all_equal_groups(rewards, group_size).float()
    return {
        "phi_mean": phi.float().sum() / max(phi.numel(), 1),
        "zero_std_frac": degenerate.sum() / max(degenerate.numel(), 1),
    }
