"""A call's checks, run before any computation so a bad call fails with a clear message,
and what they return: the call's batch (``batch.py``).

Shape, dtype and device checks cost nothing. The value checks (finite log-probs at
response tokens, finite rewards, rewards and anchor in [0, 1] under HA-DW, a 0/1 mask)
read flags back from the device in one host synchronisation (``value_checks.py``), which
``check_values=False`` skips in a hot loop. Without them a NaN input gives a NaN loss on
every backend: never a finite wrong number. Labels in the vocabulary are checked on every
call (one min/max over int labels, or an asynchronous assert).

Rewards outside [0, 1] are accepted without HA-DW (any real reward has a group-relative
advantage). With HA-DW they are refused: the anchor is a belief about an accuracy (the
paper's y_t), and Phi = lambda exp(|p - C|) is only bounded by lambda e for p and C in
[0, 1]; scale the rewards into [0, 1] first.
"""

from __future__ import annotations

import math

import torch

from .. import distributed
from ..batch.active_rows import RowSelection, active_rows
from ..batch.inputs import CallInputs, LinearHead, LinearInputs, SurrogateBatch, build_batch, build_head, flat_labels
from ..batch.token_layout import TokenLayout
from ..config.loss_config import LossConfig
from ..tables.aggregations import AGGREGATIONS
from ..tables.bounds import compiling
from ..tables.estimators import BATCH_TOTALS, ESTIMATORS, scope_names
from . import values as value_checks
from .arguments import (
    check_anchor,
    check_generator,
    check_temperature,
    require_float,
    require_layout_shape,
    require_per_segment,
    require_per_token,
    require_tensor,
    require_values_device,
    shape,
)
from .values import assert_cu_seqlens, assert_label_range, check_group_index, check_prior


def batch_layout(response_mask, cu_seqlens) -> TokenLayout:
    """The batch's layout from the response mask and ``cu_seqlens``: padded ([B, T] mask,
    no offsets) or packed ([N] or [1, N] mask, offsets [S+1], int32 or int64, on the
    mask's device). The offsets' values (0 first, N last, non-decreasing) are checked with
    the other values (``value_checks.check_values``), or by ``assert_cu_seqlens``."""
    require_tensor("response_mask", response_mask)
    if cu_seqlens is None:
        if response_mask.dim() != 2:
            hint = ": a packed batch passes cu_seqlens" if response_mask.dim() == 1 else ""
            raise ValueError(f"response_mask must be [B, T], got shape {shape(response_mask)}{hint}")
        rows, width = response_mask.shape
        return TokenLayout.padded(rows, width, response_mask.device)
    require_tensor("cu_seqlens", cu_seqlens)
    if response_mask.dim() not in (1, 2) or (response_mask.dim() == 2 and response_mask.shape[0] != 1):
        raise ValueError(
            f"response_mask has shape {shape(response_mask)}, but this call is packed (cu_seqlens given): per-token "
            "tensors are [N] or [1, N]; a padded [B, T] batch takes no cu_seqlens"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64 (flash-attention's offsets), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [S+1] (0 first, N last), got shape {shape(cu_seqlens)}")
    if cu_seqlens.device != response_mask.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, response_mask on {response_mask.device}: "
                         "they must be on one device")
    return TokenLayout.packed(cu_seqlens, shape(response_mask))


def surrogate_batch(config: LossConfig, call: CallInputs, *, check_values: bool,
                    with_metrics: bool) -> SurrogateBatch:
    """A ``call`` of ``fused_hadw_grpo_loss`` checked (the per-token log-probs, then the
    batch's other tensors: :func:`check_batch_inputs`; with ``check_values`` their values
    in one host read) and its batch (``batch.build_batch``)."""
    logprobs = require_tensor("logprobs", call.logprobs)
    layout = batch_layout(call.response_mask, call.cu_seqlens)
    require_float("logprobs", logprobs)
    require_layout_shape("logprobs", logprobs, layout)
    check_batch_inputs(layout, config, call, inputs={"logprobs": logprobs})
    if check_values:
        _check_call_values(layout, config, call)
        _check_estimator_values(layout, config, call)
    else:
        assert_cu_seqlens(layout)
    return build_batch(layout, config, call, with_metrics=with_metrics)


def linear_batch(config: LossConfig, call: CallInputs, linear: LinearInputs, *, select_rows: bool,
                 check_values: bool, with_metrics: bool) -> tuple[SurrogateBatch, LinearHead]:
    """A ``call`` of ``fused_linear_hadw_grpo_loss`` checked (the hidden states and the
    head: :func:`check_linear_inputs`; the batch's other tensors:
    :func:`check_batch_inputs`; with ``check_values`` every value, labels in the
    vocabulary and finite hidden states at response tokens included, in one host read,
    else the labels' and offsets' asynchronous asserts) and its batch and head. Padding
    is masked out of the loss; as ignored labels its rows are inactive (active_rows.py),
    and labels there are never checked or read. With ``select_rows`` (a backend that does
    not find the active rows itself, ``Backend.compacts_rows``) the checks' read counts
    the active rows too, and the head sweeps those alone; otherwise, or without the
    checks, every row."""
    layout = batch_layout(call.response_mask, call.cu_seqlens)
    check_linear_inputs(linear.hidden_states, linear.lm_head_weight, linear.labels, linear.lm_head_bias,
                        linear.temperature, layout)
    check_batch_inputs(layout, config, call, inputs={"hidden_states": linear.hidden_states})
    batch = build_batch(layout, config, call, with_metrics=with_metrics)
    hidden = layout.flat_rows(linear.hidden_states)
    labels = flat_labels(layout, batch, linear)
    active = count = None
    if check_values:
        active = active_rows(labels, linear.ignore_index) if select_rows else None
        # Every value check of this call, and the count of the active rows, in one host
        # read (docs/architecture.md, "Host synchronisation").
        count = _check_call_values(layout, config, call, batch=batch,
                                   linear=(hidden, labels, linear.lm_head_weight.shape[0], linear.ignore_index),
                                   active=active)
        _check_estimator_values(layout, config, call)
    else:
        assert_label_range(labels, linear.lm_head_weight.shape[0], linear.ignore_index)
        assert_cu_seqlens(layout)
    return batch, build_head(linear, hidden, labels, RowSelection.of(active, count))


def read_inputs(config: LossConfig, call: CallInputs) -> dict[str, torch.Tensor]:
    """The float inputs a call's loss reads, by name, for ``value_checks.check_values``:
    the log-probs, the old and (with a KL term) the reference log-probs, the rewards or
    advantages and the importance weights, per token or per response; None ones left out."""
    read = {"logprobs": call.logprobs, "old_logprobs": call.old_logprobs, "rewards": call.rewards,
            "advantages": call.advantages, "importance_weights": call.importance_weights}
    if config.beta > 0:
        read["ref_logprobs"] = call.ref_logprobs
    return {name: value for name, value in read.items() if value is not None}


def _check_call_values(layout: TokenLayout, config: LossConfig, call: CallInputs, *, batch=None, linear=None,
                       active=None) -> int | None:
    """``value_checks.check_values`` on a call's values: the float inputs its loss reads
    (:func:`read_inputs`), its anchor, its rollout log-probs and entropies; for the linear
    loss (``batch`` and ``linear`` given) its behaviour log-probs as the batch holds them
    and its hidden states and labels. Returns the count of the ``active`` rows (or None)."""
    if batch is None:
        return value_checks.check_values(layout, call.response_mask, read_inputs(config, call), anchor=call.anchor,
                                         correction=(call.rollout_logprobs, call.entropy))
    read = read_inputs(config, call)
    if batch.old_logprobs is not None:
        read["old_logprobs"] = batch.old_logprobs
    return value_checks.check_values(layout, batch.mask, read, anchor=call.anchor, linear=linear,
                                     correction=(batch.rollout_logprobs, None), active=active)


def _check_estimator_values(layout: TokenLayout, config: LossConfig, call: CallInputs) -> None:
    """What the estimator reads beyond the rewards, by value: the whole batch's totals
    (:func:`_check_batch_totals`) and the prompts' pseudo-counts
    (``values.check_prior_values``), each one more host read in the calls that pass them."""
    if call.batch_totals is not None:
        _check_batch_totals(layout, config, call.batch_totals)
    if call.prior is not None and call.rewards is not None:
        group_size = config.reward_group_size()
        dense = torch.arange(layout.segments, device=call.rewards.device) // group_size
        value_checks.check_prior_values(call.prior, call.rewards, dense, layout.segments // group_size)


def _check_batch_totals(layout: TokenLayout, config: LossConfig, totals: torch.Tensor) -> None:
    """The whole batch's totals hold this call's groups and responses, and two groups or
    more (one more host read, in the calls that pass them)."""
    values = dict(zip(BATCH_TOTALS, totals.tolist()))
    groups = layout.segments // config.reward_group_size()
    if not all(math.isfinite(value) for value in values.values()) or values["groups"] < max(groups, 2) or \
            values["responses"] < layout.segments:
        raise ValueError(f"batch_totals must be finite and count this call's {groups} groups and {layout.segments} "
                         f"responses among two groups or more, got {values['groups']:g} groups and "
                         f"{values['responses']:g} responses")


def _refuse_partial_batch(name: str, groups: int) -> None:
    """Where a call's own groups cannot be the batch a "batch"-scope estimator reads,
    without the whole batch's totals: one group, or one rank's share of a distributed batch."""
    if groups < 2:
        raise ValueError(f"advantage_estimator={name!r} reads the batch's other groups and this call "
                         f"holds {groups}: pass batch_totals (hadw_kernels.batch_totals over the whole "
                         "batch), or advantages from hadw_advantages over it")
    if distributed.world_size() > 1:
        raise ValueError(f"advantage_estimator={name!r} under torch.distributed would read this rank's "
                         "groups alone: pass batch_totals (hadw_kernels.batch_totals(..., all_reduce=True)), "
                         "or advantages from hadw_advantages over the gathered batch")


def check_batch_inputs(layout: TokenLayout, config: LossConfig, call: CallInputs, *,
                       inputs: dict[str, torch.Tensor]) -> None:
    """Shapes, dtypes and devices of a batch's tensors besides what the loss is computed
    from (``inputs``: the log-probs, or the hidden states; only their device is read
    here), against the batch's ``layout`` (:func:`batch_layout`): per-token tensors in
    its shape, per-response ones [S]; and the ``generator`` of a draw. Options that need
    a layout's width are checked here too."""
    batch = layout.segments
    old_logprobs, rewards, advantages, anchor = call.old_logprobs, call.rewards, call.advantages, call.anchor
    group_index, ref_logprobs, importance_weights = call.group_index, call.ref_logprobs, call.importance_weights
    tensors = {**inputs, "response_mask": call.response_mask}
    if layout.is_packed:
        tensors["cu_seqlens"] = layout.cu_seqlens
    if old_logprobs is not None:
        require_per_token("old_logprobs", old_logprobs, layout)
        tensors["old_logprobs"] = old_logprobs
    if layout.is_packed and AGGREGATIONS[config.loss_agg_mode].times_max_length and config.max_response_length is None:
        raise ValueError(
            f"loss_agg_mode={config.loss_agg_mode!r} divides by a constant length L, which a packed batch does not "
            "have (a padded one defaults to its width): pass max_response_length (e.g. the generation budget)"
        )
    if (rewards is None) == (advantages is None):
        raise ValueError(
            "pass exactly one of rewards (the advantages are computed per group, groups contiguous) "
            "and advantages (computed by the caller, e.g. with hadw_advantages)"
        )
    if rewards is not None:
        require_tensor("rewards", rewards)
        require_float("rewards", rewards)
        require_per_segment("rewards", rewards, layout)
        if config.group_size is None:
            raise ValueError("rewards need group_size (responses per prompt, each group's rows contiguous)")
        if batch % config.group_size != 0:
            raise ValueError(
                f"batch of {batch} responses is not divisible by group_size={config.group_size}; "
                "each group's responses must be contiguous and complete"
            )
        tensors["rewards"] = rewards
        estimator = ESTIMATORS[config.advantage_estimator]
        check_prior(estimator.scope, estimator.name, call.prior, rewards)
        if call.prior is not None:
            tensors["prior"] = call.prior
        if estimator.scope == "batch" and call.batch_totals is None:
            _refuse_partial_batch(estimator.name, batch // config.group_size)
    else:
        advantages = require_tensor("advantages", advantages)
        require_float("advantages", advantages)
        if shape(advantages) != (batch,):
            # Per token (verl's [B, T], process rewards): the layout's per-token shape.
            try:
                require_layout_shape("advantages", advantages, layout)
            except ValueError as error:
                raise ValueError(f"{error}; or one advantage per response, [{batch}]") from None
        if anchor is not None:
            raise ValueError(
                "anchor applies HA-DW to advantages computed from rewards; with advantages=, fold Phi in "
                "when you compute them (hadw_advantages(..., anchor=...))"
            )
        if group_index is not None:
            raise ValueError("group_index checks the groups of rewards; advantages need none")
        if call.batch_totals is not None:
            raise ValueError(f"batch_totals are read by advantage_estimator={scope_names('batch')} from rewards; "
                             "advantages= are formed already (hadw_advantages over the whole batch)")
        if call.prior is not None:
            raise ValueError(f"prior is read by advantage_estimator={scope_names('history')} from rewards; "
                             "advantages= are formed already (hadw_advantages(..., prior=...))")
        if config.advantage_estimator != "grpo":
            raise ValueError(f"advantage_estimator={config.advantage_estimator!r} forms the advantages from rewards; "
                             "advantages= are formed already: pass the estimator to hadw_advantages instead")
        tensors["advantages"] = advantages
    if call.batch_totals is not None:
        if ESTIMATORS[config.advantage_estimator].scope != "batch":
            raise ValueError(f"batch_totals are read by advantage_estimator={scope_names('batch')} only, not "
                             f"{config.advantage_estimator!r}")
        require_tensor("batch_totals", call.batch_totals)
        require_float("batch_totals", call.batch_totals)
        if shape(call.batch_totals) != (len(BATCH_TOTALS),):
            raise ValueError(f"batch_totals must be [{len(BATCH_TOTALS)}] (hadw_kernels.batch_totals), "
                             f"got shape {shape(call.batch_totals)}")
        tensors["batch_totals"] = call.batch_totals
    if group_index is not None:
        require_tensor("group_index", group_index)
        require_per_segment("group_index", group_index, layout)
        tensors["group_index"] = group_index
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (the reference policy's log-probs)")
    if ref_logprobs is not None:
        require_per_token("ref_logprobs", ref_logprobs, layout)
        tensors["ref_logprobs"] = ref_logprobs
    if importance_weights is not None:
        require_tensor("importance_weights", importance_weights)
        require_float("importance_weights", importance_weights)
        per_response = shape(importance_weights) == (batch,)
        if not per_response:
            try:
                require_layout_shape("importance_weights", importance_weights, layout)
            except ValueError as error:
                raise ValueError(f"{error}; or one weight per response, [{batch}]") from None
        tensors["importance_weights"] = importance_weights
    tensors.update(_correction_inputs(layout, config, call.rollout_logprobs, call.entropy,
                                      linear="hidden_states" in inputs))
    check_anchor(anchor)
    if isinstance(anchor, torch.Tensor):
        tensors["anchor"] = anchor
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    device = next(iter(devices.values()))
    require_values_device(next(iter(devices)), device)
    check_generator(call.generator, device)
    if group_index is not None and not compiling():  # a value check (docs/architecture.md)
        check_group_index(group_index, config.reward_group_size())


def _correction_inputs(layout: TokenLayout, config: LossConfig, rollout_logprobs, entropy, *,
                       linear: bool) -> dict[str, torch.Tensor]:
    """The rollout correction's and entropy mask's tensors, per token, present exactly when
    the options read them (docs/options.md, "Rollout correction")."""
    tensors = {}
    if config.rollout_correction is not None and rollout_logprobs is None:
        raise ValueError("rollout_correction needs rollout_logprobs (the rollout engine's log-probs of the tokens)")
    if rollout_logprobs is not None:
        if config.rollout_correction is None and config.off_policy_mask_threshold is None:
            raise ValueError("rollout_logprobs are read by rollout_correction or off_policy_mask_threshold; "
                             "neither is set, so they would be ignored")
        require_per_token("rollout_logprobs", rollout_logprobs, layout)
        tensors["rollout_logprobs"] = rollout_logprobs
    if linear:  # (it forms the entropy itself)
        return tensors
    if config.top_entropy_quantile < 1.0 and entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs entropy, each token's entropy under the current policy "
                         "(the linear loss forms it itself)")
    if entropy is not None:
        if config.top_entropy_quantile == 1.0:
            raise ValueError("entropy is read by top_entropy_quantile < 1 only; it would be ignored")
        require_per_token("entropy", entropy, layout)
        tensors["entropy"] = entropy
    return tensors


def check_linear_inputs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    layout: TokenLayout | None = None,
) -> None:
    """The linear inputs: hidden states [..., H] with a label each. With the losses'
    ``layout`` (:func:`batch_layout`) they follow its per-token shape: [B, T, H] padded,
    [N, H] or [1, N, H] packed; the log-probs alone take any leading shape."""
    require_tensor("hidden_states", hidden_states)
    require_tensor("lm_head_weight", lm_head_weight)
    require_tensor("labels", labels)
    if layout is None:
        if hidden_states.dim() < 2:
            raise ValueError(f"hidden_states must be [..., H] (e.g. [B, T, H] or [N, H]), got {shape(hidden_states)}")
        if shape(labels) != shape(hidden_states)[:-1]:
            raise ValueError(f"labels must be hidden_states' shape without H, {shape(hidden_states)[:-1]}, got "
                             f"{shape(labels)}")
    elif not layout.is_packed:
        if shape(hidden_states)[:-1] != layout.shape or hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [B, T, H] with [B, T] = {layout.shape} (response_mask's "
                             f"shape), got {shape(hidden_states)}")
        require_layout_shape("labels", labels, layout)
    else:
        if hidden_states.dim() not in (2, 3) or shape(hidden_states)[:-1] not in ((layout.tokens,), (1, layout.tokens)):
            raise ValueError(
                f"hidden_states has shape {shape(hidden_states)}, but this call is packed (cu_seqlens given): "
                f"they are [N, H] or [1, N, H] with N = {layout.tokens}"
            )
        require_layout_shape("labels", labels, layout)
    if lm_head_weight.dim() != 2:
        raise ValueError(f"lm_head_weight must be [V, H], got shape {shape(lm_head_weight)}")
    if lm_head_weight.shape[0] == 0:
        raise ValueError("lm_head_weight has an empty vocabulary")
    require_float("hidden_states", hidden_states)
    require_float("lm_head_weight", lm_head_weight)
    if lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(
            f"lm_head_weight is [V, H] = {shape(lm_head_weight)} but hidden_states have "
            f"H = {hidden_states.shape[-1]}"
        )
    if hidden_states.dtype != lm_head_weight.dtype:
        raise TypeError(
            f"hidden_states ({hidden_states.dtype}) and lm_head_weight ({lm_head_weight.dtype}) "
            "must share a dtype"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}")
    if lm_head_bias is not None:
        require_tensor("lm_head_bias", lm_head_bias)
        if shape(lm_head_bias) != (lm_head_weight.shape[0],):
            raise ValueError(f"lm_head_bias must be [V] = [{lm_head_weight.shape[0]}], got {shape(lm_head_bias)}")
        if lm_head_bias.dtype != lm_head_weight.dtype:
            raise TypeError(f"lm_head_bias ({lm_head_bias.dtype}) must share the LM head's dtype ({lm_head_weight.dtype})")
    check_temperature(temperature)
    devices = {hidden_states.device, lm_head_weight.device, labels.device}
    if len(devices) > 1:
        raise ValueError(f"hidden_states, lm_head_weight and labels must be on one device, got {devices}")
    require_values_device("hidden_states", hidden_states.device)
