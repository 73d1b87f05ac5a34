"""Input checks, run before any computation so a bad call fails with a clear message.

Shape, dtype and device checks cost nothing. The value checks (finite rewards, a 0/1
mask, a finite anchor) read one flag back from the device: on CUDA that is one host
synchronisation, which ``check_values=False`` skips in a hot loop.
"""

from __future__ import annotations

import math

import torch

from .config import LossConfig


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_float(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def check_surrogate_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: LossConfig,
    *,
    anchor=None,
    ref_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    check_values: bool = True,
) -> None:
    for name, value in (
        ("logprobs", logprobs),
        ("old_logprobs", old_logprobs),
        ("rewards", rewards),
        ("response_mask", response_mask),
    ):
        _require_tensor(name, value)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {_shape(logprobs)}")
    batch = logprobs.shape[0]
    _require_float("logprobs", logprobs)
    _require_float("old_logprobs", old_logprobs)
    _require_float("rewards", rewards)
    if _shape(old_logprobs) != _shape(logprobs):
        raise ValueError(
            f"old_logprobs has shape {_shape(old_logprobs)}, logprobs {_shape(logprobs)}: they must match"
        )
    if _shape(response_mask) != _shape(logprobs):
        raise ValueError(
            f"response_mask has shape {_shape(response_mask)}, logprobs {_shape(logprobs)}: they must match"
        )
    if _shape(rewards) != (batch,):
        raise ValueError(f"rewards must be [B] = [{batch}], got shape {_shape(rewards)}")
    if batch % config.group_size != 0:
        raise ValueError(
            f"batch of {batch} responses is not divisible by group_size={config.group_size}; "
            "each group's responses must be contiguous and complete"
        )
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "rewards": rewards, "response_mask": response_mask}
    if config.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (the reference policy's log-probs)")
    if ref_logprobs is not None:
        _require_tensor("ref_logprobs", ref_logprobs)
        _require_float("ref_logprobs", ref_logprobs)
        if _shape(ref_logprobs) != _shape(logprobs):
            raise ValueError(
                f"ref_logprobs has shape {_shape(ref_logprobs)}, logprobs {_shape(logprobs)}: they must match"
            )
        tensors["ref_logprobs"] = ref_logprobs
    if importance_weights is not None:
        _require_tensor("importance_weights", importance_weights)
        _require_float("importance_weights", importance_weights)
        allowed = [(batch,)] if config.sequence_level else [(batch,), _shape(logprobs)]
        if _shape(importance_weights) not in allowed:
            raise ValueError(
                f"importance_weights must have shape {' or '.join(map(str, allowed))} for "
                f"loss_type={config.loss_type!r}, got {_shape(importance_weights)}"
            )
        tensors["importance_weights"] = importance_weights
    if isinstance(anchor, torch.Tensor):
        if anchor.dim() != 0:
            raise ValueError(f"anchor must be a float or a 0-d tensor, got shape {_shape(anchor)}")
        tensors["anchor"] = anchor
    elif anchor is not None and not isinstance(anchor, (int, float)):
        raise TypeError(f"anchor must be a float, a 0-d tensor or None, got {type(anchor).__name__}")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")

    if check_values:
        _check_values(rewards, response_mask, anchor)


def _check_values(rewards: torch.Tensor, response_mask: torch.Tensor, anchor) -> None:
    if isinstance(anchor, (int, float)) and not math.isfinite(anchor):
        raise ValueError(f"anchor must be finite, got {anchor}")
    bad_rewards = ~torch.isfinite(rewards).all()
    bad_mask = ((response_mask != 0) & (response_mask != 1)).any()
    flags = [bad_rewards, bad_mask]
    if isinstance(anchor, torch.Tensor):
        flags.append(~torch.isfinite(anchor.float()))
    flags = torch.stack(flags).tolist()  # the one host synchronisation
    if flags[0]:
        raise ValueError("rewards contain NaN or inf")
    if flags[1]:
        raise ValueError("response_mask must contain only 0 and 1")
    if len(flags) > 2 and flags[2]:
        raise ValueError(f"anchor must be finite, got {anchor}")


def check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Labels index the vocabulary or equal ignore_index (one host sync on CUDA)."""
    out_of_range = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if bool(out_of_range.any()):
        raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}")


def check_linear_inputs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
) -> None:
    _require_tensor("hidden_states", hidden_states)
    _require_tensor("lm_head_weight", lm_head_weight)
    _require_tensor("labels", labels)
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be [B, T, H], got shape {_shape(hidden_states)}")
    if lm_head_weight.dim() != 2:
        raise ValueError(f"lm_head_weight must be [V, H], got shape {_shape(lm_head_weight)}")
    _require_float("hidden_states", hidden_states)
    _require_float("lm_head_weight", lm_head_weight)
    if lm_head_weight.shape[1] != hidden_states.shape[2]:
        raise ValueError(
            f"lm_head_weight is [V, H] = {_shape(lm_head_weight)} but hidden_states have "
            f"H = {hidden_states.shape[2]}"
        )
    if hidden_states.dtype != lm_head_weight.dtype:
        raise TypeError(
            f"hidden_states ({hidden_states.dtype}) and lm_head_weight ({lm_head_weight.dtype}) "
            "must share a dtype"
        )
    if _shape(labels) != _shape(hidden_states)[:2]:
        raise ValueError(f"labels must be [B, T] = {_shape(hidden_states)[:2]}, got {_shape(labels)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")
    if lm_head_bias is not None:
        _require_tensor("lm_head_bias", lm_head_bias)
        if _shape(lm_head_bias) != (lm_head_weight.shape[0],):
            raise ValueError(f"lm_head_bias must be [V] = [{lm_head_weight.shape[0]}], got {_shape(lm_head_bias)}")
        if lm_head_bias.dtype != lm_head_weight.dtype:
            raise TypeError(f"lm_head_bias ({lm_head_bias.dtype}) must share the LM head's dtype ({lm_head_weight.dtype})")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    devices = {hidden_states.device, lm_head_weight.device, labels.device}
    if len(devices) > 1:
        raise ValueError(f"hidden_states, lm_head_weight and labels must be on one device, got {devices}")
