"""Group-relative advantages and the HA-DW weights Phi (SPEC sections 2 and 4).

Plain PyTorch: this is the reference that every kernel's advantage is tested against,
and the building block for users who wire their own loss.
"""

from __future__ import annotations

import torch

STD_EPS = 1e-6


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of length {rewards.numel()} do not split into groups of {group_size}"
        )
    # Advantages are at least fp32: bf16 rewards would round k/G.
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    return rewards.to(dtype).view(-1, group_size)


def _degenerate(grouped: torch.Tensor) -> torch.Tensor:
    """Groups whose rewards are all equal. Tested by min == max, not by std == 0:
    the mean of equal non-dyadic rewards is not always bit-equal to them."""
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True
) -> torch.Tensor:
    """A_hat_i = (r_i - mean_g) / (std_g + 1e-6), or r_i - mean_g without the std.

    ``rewards`` is [B] with each group's ``group_size`` responses contiguous. The std is
    unbiased (as ``torch.std``). A group whose rewards are all equal gets exactly 0.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    centred = torch.where(_degenerate(grouped)[:, None], torch.zeros_like(centred), centred)
    return centred.reshape(-1)


def hadw_weights(
    rewards: torch.Tensor,
    group_size: int,
    anchor: float | torch.Tensor,
    *,
    lambda_scale: float = 1.3,
) -> torch.Tensor:
    """Phi_i = lambda_scale * exp(D_i * M_g), with D_i = -sgn(A_hat_i) sgn(p_hat_g - C)
    and M_g = |p_hat_g - C|.

    ``anchor`` is the belief C (a float or a 0-d tensor, e.g. from
    :meth:`DifficultyAnchor.update`). Phi depends on A_hat only through its sign, which
    the std normalisation does not change, so it is the same for every loss type.
    The result carries no gradient.
    """
    grouped = _grouped(rewards, group_size).detach()
    group_mean = grouped.mean(dim=1, keepdim=True)
    advantage_sign = torch.sign(grouped - group_mean)
    advantage_sign = torch.where(
        _degenerate(grouped)[:, None], torch.zeros_like(advantage_sign), advantage_sign
    )
    anchor = torch.as_tensor(anchor, dtype=grouped.dtype, device=grouped.device)
    if anchor.dim() != 0:
        raise ValueError(f"anchor must be a scalar, got shape {tuple(anchor.shape)}")
    difficulty = group_mean - anchor
    exponent = -advantage_sign * torch.sign(difficulty) * difficulty.abs()
    return (lambda_scale * torch.exp(exponent)).reshape(-1)
