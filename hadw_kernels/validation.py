"""Input checks, run before any computation so a bad call fails with a clear message.

Shape, dtype and device checks cost nothing. The value checks (finite log-probs at
response tokens, finite rewards, rewards and anchor in [0, 1] under HA-DW, a 0/1 mask)
read flags back from the device: on CUDA that is one host synchronisation, which
``check_values=False`` skips in a hot loop. Without them a NaN input gives a NaN loss on
every backend: never a finite wrong number. Labels in the vocabulary are checked on every
call (``check_label_range``: one min/max over int labels).

Rewards outside [0, 1] are accepted without HA-DW (any real reward has a group-relative
advantage). With HA-DW they are refused: the anchor is a belief about an accuracy (the
paper's y_t), and Phi = lambda exp(|p - C|) is only bounded by lambda e for p and C in
[0, 1]; scale the rewards into [0, 1] first.
"""

from __future__ import annotations

import math

import torch

from .active_rows import RowSelection, active_rows
from .aggregation_table import AGGREGATIONS
from .batch import LinearHead, SurrogateBatch, build_batch
from .checks import check_finite_positive
from .config import LossConfig
from .layout import TokenLayout
from .ops import detached
from .precision import accumulate_dtype


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def device_of(name: str, value) -> torch.device:
    """The device of the tensor argument ``name`` (refused by name if not a tensor)."""
    return _require_tensor(name, value).device


def _require_float(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def _require_per_token(name: str, tensor, layout: TokenLayout) -> None:
    """A floating-point per-token tensor of the batch's layout."""
    _require_tensor(name, tensor)
    _require_float(name, tensor)
    _require_layout_shape(name, tensor, layout)


def _require_layout_shape(name: str, tensor: torch.Tensor, layout: TokenLayout) -> None:
    """A padded batch's per-token tensors are [B, T], the response mask's shape; a packed
    batch's are [N] or [1, N], whatever form the mask came in."""
    if not layout.is_packed:
        if _shape(tensor) != layout.shape:
            raise ValueError(f"{name} has shape {_shape(tensor)}, response_mask {layout.shape}: they must match")
    elif _shape(tensor) not in ((layout.tokens,), (1, layout.tokens)):
        raise ValueError(
            f"{name} has shape {_shape(tensor)}, but this call is packed (cu_seqlens given): per-token tensors are "
            f"[N] = [{layout.tokens}] or [1, N]; a padded [B, T] batch takes no cu_seqlens"
        )


def _require_per_segment(name: str, tensor: torch.Tensor, layout: TokenLayout) -> None:
    if _shape(tensor) != (layout.segments,):
        what = "segment (len(cu_seqlens) - 1)" if layout.is_packed else "response"
        unit = "S" if layout.is_packed else "B"
        raise ValueError(f"{name} must be [{unit}] = [{layout.segments}], one per {what}, got shape {_shape(tensor)}")


def batch_layout(response_mask, cu_seqlens) -> TokenLayout:
    """The batch's layout from the response mask and ``cu_seqlens``: padded ([B, T] mask,
    no offsets) or packed ([N] or [1, N] mask, offsets [S+1], int32 or int64, on the
    mask's device). The offsets' values (0 first, N last, non-decreasing) are checked with
    the other values (:func:`_check_values`), or by :func:`assert_cu_seqlens`."""
    _require_tensor("response_mask", response_mask)
    if cu_seqlens is None:
        if response_mask.dim() != 2:
            hint = ": a packed batch passes cu_seqlens" if response_mask.dim() == 1 else ""
            raise ValueError(f"response_mask must be [B, T], got shape {_shape(response_mask)}{hint}")
        return TokenLayout.padded(*response_mask.shape, response_mask.device)
    _require_tensor("cu_seqlens", cu_seqlens)
    if response_mask.dim() not in (1, 2) or (response_mask.dim() == 2 and response_mask.shape[0] != 1):
        raise ValueError(
            f"response_mask has shape {_shape(response_mask)}, but this call is packed (cu_seqlens given): per-token "
            "tensors are [N] or [1, N]; a padded [B, T] batch takes no cu_seqlens"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64 (flash-attention's offsets), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [S+1] (0 first, N last), got shape {_shape(cu_seqlens)}")
    if cu_seqlens.device != response_mask.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, response_mask on {response_mask.device}: "
                         "they must be on one device")
    return TokenLayout.packed(cu_seqlens, _shape(response_mask))


def _cu_seqlens_faults(cu_seqlens: torch.Tensor, tokens: int) -> dict[str, torch.Tensor]:
    """0-d flags, true where ``cu_seqlens`` breaks a rule."""
    return {
        "does not start at 0": cu_seqlens[0] != 0,
        f"does not end at N = {tokens} (the per-token tensors' length)": cu_seqlens[-1] != tokens,
        "decreases (segments must not overlap)": (cu_seqlens[1:] < cu_seqlens[:-1]).any(),
    }


def _raise_cu_seqlens(cu_seqlens: torch.Tensor, tokens: int) -> None:
    for fault, flag in _cu_seqlens_faults(cu_seqlens, tokens).items():
        if bool(flag):
            shown = cu_seqlens.tolist()
            shown = shown if len(shown) <= 12 else shown[:6] + ["..."] + shown[-6:]
            raise ValueError(f"cu_seqlens {fault}: {shown}")


def assert_cu_seqlens(layout: TokenLayout) -> None:
    """The offsets' check of calls that read no value (``check_values=False``, compiled
    calls), as :func:`assert_label_range`: offsets outside [0, N] would make the kernels
    read outside the tensors, so they are checked on every call."""
    if not layout.is_packed:
        return
    cu_seqlens = layout.cu_seqlens
    valid = ~torch.stack(list(_cu_seqlens_faults(cu_seqlens, layout.tokens).values())).any()
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        try:
            torch._assert_async(valid, "cu_seqlens")
        except RuntimeError:
            _raise_cu_seqlens(cu_seqlens, layout.tokens)
    else:
        torch._assert_async(valid, f"cu_seqlens must start at 0, end at N = {layout.tokens} and never decrease")


def check_anchor(anchor) -> None:
    """A belief C in [0, 1]: a float or a 0-d tensor (its value is checked with the others)."""
    if anchor is None:
        return
    if isinstance(anchor, bool) or not isinstance(anchor, (int, float, torch.Tensor)):
        raise TypeError(f"anchor must be a float in [0, 1], a 0-d tensor or None, got {anchor!r}")
    if isinstance(anchor, torch.Tensor):
        if anchor.dim() != 0:
            raise ValueError(f"anchor must be a float or a 0-d tensor, got shape {_shape(anchor)}")
        if not anchor.is_floating_point():
            raise TypeError(f"anchor must be a floating-point tensor, got {anchor.dtype}")
    # Compiled, a float argument is symbolic: its range is a value check, skipped as the
    # others are (docs/architecture.md, "torch.compile").
    elif not torch.compiler.is_compiling() and not (math.isfinite(anchor) and 0 <= anchor <= 1):
        raise ValueError(f"anchor must lie in [0, 1] (a belief about an accuracy), got {anchor}")


def surrogate_batch(
    config: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None,
    rewards: torch.Tensor | None,
    advantages: torch.Tensor | None,
    group_index: torch.Tensor | None,
    anchor,
    ref_logprobs: torch.Tensor | None,
    importance_weights: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    generator,
    check_values: bool,
    with_metrics: bool,
) -> SurrogateBatch:
    """A call of ``fused_hadw_grpo_loss`` checked (the per-token log-probs, then the
    batch's other tensors: :func:`check_batch_inputs`; with ``check_values`` their values
    in one host read) and its batch (``batch.build_batch``)."""
    _require_tensor("logprobs", logprobs)
    layout = batch_layout(response_mask, cu_seqlens)
    _require_float("logprobs", logprobs)
    _require_layout_shape("logprobs", logprobs, layout)
    tensors = dict(rewards=rewards, advantages=advantages, anchor=anchor, ref_logprobs=ref_logprobs,
                   importance_weights=importance_weights, rollout_logprobs=rollout_logprobs, entropy=entropy,
                   generator=generator)
    check_batch_inputs(layout, response_mask, old_logprobs, config, inputs={"logprobs": logprobs},
                       group_index=group_index, **tensors)
    if check_values:
        _check_values(layout, response_mask, read_inputs(config, logprobs=logprobs, old_logprobs=old_logprobs,
                                                         **tensors),
                      anchor=anchor, correction=(rollout_logprobs, entropy))
    else:
        assert_cu_seqlens(layout)
    return build_batch(layout, config, logprobs, old_logprobs, response_mask, with_metrics=with_metrics, **tensors)


def linear_batch(
    config: LossConfig,
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None,
    lm_head_bias: torch.Tensor | None,
    rewards: torch.Tensor | None,
    advantages: torch.Tensor | None,
    group_index: torch.Tensor | None,
    anchor,
    ref_logprobs: torch.Tensor | None,
    importance_weights: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    generator,
    temperature: float,
    ignore_index: int,
    block_rows: int | None,
    select_rows: bool,
    check_values: bool,
    with_metrics: bool,
) -> tuple[SurrogateBatch, LinearHead]:
    """A call of ``fused_linear_hadw_grpo_loss`` checked (the hidden states and the head:
    :func:`check_linear_inputs`; the batch's other tensors: :func:`check_batch_inputs`;
    with ``check_values`` every value, labels in the vocabulary and finite hidden states
    at response tokens included, in one host read, else the labels' and offsets'
    asynchronous asserts) and its batch and head. Padding is masked out of the loss; as
    ignored labels its rows are inactive (active_rows.py), and labels there are never
    checked or read. With ``select_rows`` (a backend that does not find the active rows
    itself, ``Backend.compacts_rows``) the checks' read counts the active rows too, and
    the head sweeps those alone; otherwise, or without the checks, every row."""
    layout = batch_layout(response_mask, cu_seqlens)
    check_linear_inputs(hidden_states, lm_head_weight, labels, lm_head_bias, temperature, layout)
    tensors = dict(rewards=rewards, advantages=advantages, anchor=anchor, ref_logprobs=ref_logprobs,
                   importance_weights=importance_weights, rollout_logprobs=rollout_logprobs, generator=generator)
    check_batch_inputs(layout, response_mask, old_logprobs, config, inputs={"hidden_states": hidden_states},
                       group_index=group_index, **tensors)
    batch = build_batch(layout, config, None, old_logprobs, response_mask, entropy=None, with_metrics=with_metrics,
                        **tensors)
    hidden = layout.flat_rows(hidden_states)
    flat_labels = layout.flat(labels).masked_fill(~batch.mask.bool(), ignore_index)
    vocab = lm_head_weight.shape[0]
    active = count = None
    if check_values:
        active = active_rows(flat_labels, ignore_index) if select_rows else None
        # Every value check of this call, and the count of the active rows, in one host
        # read (docs/architecture.md, "Host synchronisation").
        count = _check_values(
            layout, batch.mask,
            read_inputs(config, old_logprobs=batch.old_logprobs, rewards=rewards, advantages=advantages,
                        importance_weights=importance_weights, ref_logprobs=ref_logprobs),
            anchor=anchor, linear=(hidden, flat_labels, vocab, ignore_index),
            correction=(batch.rollout_logprobs, None), active=active,
        )
    else:
        assert_label_range(flat_labels, vocab, ignore_index)
        assert_cu_seqlens(layout)
    rows = RowSelection.of(active, count)
    head = LinearHead(hidden_states, rows.take(hidden), lm_head_weight, lm_head_bias, rows.take(flat_labels),
                      temperature, ignore_index, block_rows, rows)
    return batch, head


def check_batch_inputs(
    layout: TokenLayout,
    response_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    config: LossConfig,
    *,
    inputs: dict[str, torch.Tensor],
    rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    anchor=None,
    ref_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    generator=None,
) -> None:
    """Shapes, dtypes and devices of a batch's tensors besides what the loss is computed
    from (``inputs``: the log-probs, or the hidden states; only their device is read
    here), against the batch's ``layout`` (:func:`batch_layout`): per-token tensors in
    its shape, per-response ones [S]; and the ``generator`` of a draw. Options that need
    a layout's width are checked here too."""
    batch = layout.segments
    tensors = {**inputs, "response_mask": response_mask}
    if layout.is_packed:
        tensors["cu_seqlens"] = layout.cu_seqlens
    if old_logprobs is not None:
        _require_per_token("old_logprobs", old_logprobs, layout)
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
        _require_tensor("rewards", rewards)
        _require_float("rewards", rewards)
        _require_per_segment("rewards", rewards, layout)
        if config.group_size is None:
            raise ValueError("rewards need group_size (responses per prompt, each group's rows contiguous)")
        if batch % config.group_size != 0:
            raise ValueError(
                f"batch of {batch} responses is not divisible by group_size={config.group_size}; "
                "each group's responses must be contiguous and complete"
            )
        tensors["rewards"] = rewards
    else:
        _require_tensor("advantages", advantages)
        _require_float("advantages", advantages)
        if _shape(advantages) != (batch,):
            # Per token (verl's [B, T], process rewards): the layout's per-token shape.
            try:
                _require_layout_shape("advantages", advantages, layout)
            except ValueError as error:
                raise ValueError(f"{error}; or one advantage per response, [{batch}]") from None
        if anchor is not None:
            raise ValueError(
                "anchor applies HA-DW to advantages computed from rewards; with advantages=, fold Phi in "
                "when you compute them (hadw_advantages(..., anchor=...))"
            )
        if group_index is not None:
            raise ValueError("group_index checks the groups of rewards; advantages need none")
        tensors["advantages"] = advantages
    if group_index is not None:
        _require_tensor("group_index", group_index)
        _require_per_segment("group_index", group_index, layout)
        tensors["group_index"] = group_index
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (the reference policy's log-probs)")
    if ref_logprobs is not None:
        _require_per_token("ref_logprobs", ref_logprobs, layout)
        tensors["ref_logprobs"] = ref_logprobs
    if importance_weights is not None:
        _require_tensor("importance_weights", importance_weights)
        _require_float("importance_weights", importance_weights)
        per_response = _shape(importance_weights) == (batch,)
        if not per_response:
            try:
                _require_layout_shape("importance_weights", importance_weights, layout)
            except ValueError as error:
                raise ValueError(f"{error}; or one weight per response, [{batch}]") from None
        tensors["importance_weights"] = importance_weights
    tensors.update(_correction_inputs(layout, config, rollout_logprobs, entropy, linear="hidden_states" in inputs))
    check_anchor(anchor)
    if isinstance(anchor, torch.Tensor):
        tensors["anchor"] = anchor
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    device = next(iter(devices.values()))
    require_values_device(next(iter(devices)), device)
    check_generator(generator, device)
    if group_index is not None and not torch.compiler.is_compiling():  # a value check (docs/architecture.md)
        _check_group_index(group_index, config.group_size)


def require_values_device(name: str, device: torch.device) -> None:
    """Tensors on the meta device have shapes and no values, which every call here computes
    and checks: refused by name before a value is read."""
    if device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds shapes but no values: hadw-kernels computes values (and "
            "checks them), so it takes tensors on a real device (cpu, cuda); torch.compile traces its calls with "
            "fake tensors of that device"
        )


def check_generator(generator, device: torch.device) -> None:
    """The draw's generator (objectives.SELECTIONS; clip_cov alone draws): None (torch's
    global one, as verl's), or a ``torch.Generator`` on the CPU (where the draw runs by
    default) or on the inputs' ``device``. Checked whatever the objective, so a wrong
    value is refused on the call that passes it, not on the first that draws."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (or None: torch's global one), got "
                        f"{type(generator).__module__}.{type(generator).__qualname__}")
    if generator.device.type != "cpu" and generator.device != device:
        raise ValueError(f"generator is on {generator.device}, the inputs on {device}: pass a generator on the "
                         "CPU or on the inputs' device")


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
        _require_per_token("rollout_logprobs", rollout_logprobs, layout)
        tensors["rollout_logprobs"] = rollout_logprobs
    if linear:  # (it forms the entropy itself)
        return tensors
    if config.top_entropy_quantile < 1.0 and entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs entropy, each token's entropy under the current policy "
                         "(the linear loss forms it itself)")
    if entropy is not None:
        if config.top_entropy_quantile == 1.0:
            raise ValueError("entropy is read by top_entropy_quantile < 1 only; it would be ignored")
        _require_per_token("entropy", entropy, layout)
        tensors["entropy"] = entropy
    return tensors


def check_advantage_options(rewards: torch.Tensor, anchor, lambda_scale, std_eps) -> None:
    """``hadw_advantages``' checks: the fused loss's own on the same values (anchor a
    finite belief in [0, 1], lambda_scale and std_eps finite and positive, finite
    rewards, in [0, 1] with an anchor), with its messages. Values are always read: one
    host sync on CUDA, once per rollout batch."""
    check_finite_positive("std_eps", std_eps)
    check_finite_positive("lambda_scale", lambda_scale)
    require_values_device("rewards", rewards.device)
    check_anchor(anchor)
    if isinstance(anchor, torch.Tensor):
        anchor = anchor.to(rewards.device)  # (a 0-d CPU anchor with CUDA rewards is accepted)
    _check_values(None, None, {"rewards": rewards}, anchor=anchor)


def _check_group_index(group_index: torch.Tensor, group_size: int) -> None:
    """Rows come in contiguous, complete groups: a trainer that shuffled rows (TRL with
    steps_per_generation > 1, verl's balance_batch) would otherwise get wrong advantages."""
    blocks = group_index.view(-1, group_size)
    uniform = (blocks == blocks[:, :1]).all()
    firsts = blocks[:, 0].sort().values
    distinct = (firsts[1:] != firsts[:-1]).all()
    if not bool(uniform & distinct):  # one host read
        raise ValueError(
            f"group_index shows rows that are not in contiguous groups of {group_size}: the rows were reordered "
            "or split; compute the advantages over the whole batch (hadw_advantages(..., group_index=...)) "
            "and pass advantages= instead"
        )


def _nonfinite_at(values: torch.Tensor, masked_out: torch.Tensor) -> torch.Tensor:
    """0-d: whether ``values`` hold a NaN or inf outside ``masked_out``. x * 0 is 0 where x
    is finite and NaN where it is not, so one sum tells, in three passes where
    ``~isfinite(x) & valid`` takes six."""
    return (values * 0).masked_fill_(masked_out, 0).sum() != 0


def read_inputs(config: LossConfig, **inputs) -> dict[str, torch.Tensor]:
    """The float inputs a call's loss reads, by name, for :func:`_check_values`: the
    log-probs, the old and (with a KL term) the reference log-probs, the rewards or
    advantages and the importance weights, per token or per response; None ones left out."""
    read = {name: inputs.get(name) for name in ("logprobs", "old_logprobs", "rewards", "advantages",
                                                "importance_weights")}
    if config.beta > 0:
        read["ref_logprobs"] = inputs.get("ref_logprobs")
    return {name: value for name, value in read.items() if value is not None}


def _count_of(active: torch.Tensor) -> torch.Tensor:
    """0-d: how many rows ``active`` marks, in float64 so that the read's stack, promoted
    to it, rounds no count (float32 would above 2^24 rows)."""
    return active.sum(dtype=torch.float64)


def _read(probes: dict[str, torch.Tensor]) -> dict:
    """The 0-d ``probes``' values in one host read: ``item()`` for one, else one
    ``tolist()`` of their stack (which promotes them to the widest dtype: no value is
    rounded)."""
    if len(probes) == 1:
        return {name: probe.item() for name, probe in probes.items()}
    return dict(zip(probes, torch.stack(list(probes.values())).tolist()))


def _check_values(layout: TokenLayout | None, response_mask, inputs: dict[str, torch.Tensor], *, anchor,
                  linear=None, correction=(None, None), active=None) -> int | None:
    """Every check from a few reductions read in one host synchronisation; a failure is
    then named by a precise check of its own. At 16k tokens on the CPU the checks cost as
    much as the loss did: each reduction here is one op, or two passes over the tokens.
    ``layout``: the batch's (its offsets join the read when packed), None without
    per-token tensors. ``inputs``: the float tensors the loss reads (:func:`read_inputs`),
    each finite at the tokens it counts if per token (NaN or inf at padding or a prompt
    token is never read), everywhere if per response ([S]: rewards, and advantages or
    importance weights given per response); rewards in [0, 1] under HA-DW (an anchor).
    ``linear``: (hidden_states, labels, vocab, ignore_index) of the linear loss, whose
    screens join the same read. ``correction``: (rollout log-probs, entropies), each None
    where the call has none: log-probs (<= 0, not NaN) and entropies (finite,
    non-negative) at counted tokens. ``active``: the linear loss's active rows, whose
    count joins the read and is returned (None: nothing counted, None returned).

    Every tensor is read detached (not under ``torch.no_grad()``, whose context costs a
    small call more than a detach does)."""
    rollout_logprobs, entropy = detached(correction[0]), detached(correction[1])
    segments = None if layout is None else layout.segments
    per_response, per_token = {}, {}
    for name, values in inputs.items():
        values = detached(values)
        if (values.dim() == 1 and values.shape[0] == segments) or (layout is None and name == "rewards"):
            per_response[name] = values
        else:
            per_token[name] = values
    if isinstance(anchor, (int, float)) and not math.isfinite(anchor):
        raise ValueError(f"anchor must be finite, got {anchor}")
    probes = {}
    if response_mask is not None and response_mask.dtype != torch.bool:
        # m (1 - m) is 0 exactly for m in {0, 1} (NaN for NaN).
        probes["mask"] = (response_mask * (1 - response_mask)).any()
    # One screen, a sum over every position of every float input (padding included): NaN
    # or inf wherever one of them is, so it clears them all when they are finite
    # everywhere (the usual case). Otherwise (a NaN in padding, or finite values
    # overflowing the sum) the precise checks below decide. Each operator here costs a
    # small call more than its arithmetic (docs/benchmarks.md, "Host time of a small
    # call"): the per-token inputs are combined before their one sum, x - y + z ...
    screen = None
    if per_token:
        values = list(per_token.values())
        if layout is not None and any(other.shape != values[0].shape for other in values[1:]):
            values = [layout.flat(other) for other in values]  # [B, T], [N] and [1, N] may come mixed
        combined = values[0]
        for sign, other in enumerate(values[1:]):
            combined = combined - other if sign % 2 == 0 else combined + other
        # (Summed in fp32 at least: fp16 would overflow at a few thousand tokens.)
        screen = combined.sum(dtype=accumulate_dtype(combined.dtype))
    hadw = anchor is not None
    for name, values in per_response.items():
        if values.numel() == 0:
            continue
        if hadw and name == "rewards":
            # Their range is read too: min and max are NaN when any value is, inf when any is.
            probes["rewards_min"], probes["rewards_max"] = torch.aminmax(values)
        else:
            total = values.sum(dtype=accumulate_dtype(values.dtype))
            screen = total if screen is None else screen + total
    if isinstance(anchor, torch.Tensor):
        probes["anchor"] = anchor
    if rollout_logprobs is not None or entropy is not None:
        counted = layout.flat(response_mask) != 0
        rollout_logprobs, entropy = layout.flat(rollout_logprobs), layout.flat(entropy)
        if rollout_logprobs is not None:
            probes["rollout_nan"] = (torch.isnan(rollout_logprobs) & counted).any()
            probes["rollout_positive"] = ((rollout_logprobs > 0) & counted).any()
        if entropy is not None:
            probes["entropy"] = ((~torch.isfinite(entropy) | (entropy < 0)) & counted).any()
    if layout is not None and layout.is_packed:
        probes["cu_seqlens"] = torch.stack(list(_cu_seqlens_faults(layout.cu_seqlens, layout.tokens).values())).any()
    if linear is not None:
        hidden_states, labels, vocab, ignore_index = linear
        probes["labels"] = _out_of_range(labels, vocab, ignore_index).any()
        hidden_states = detached(hidden_states)
        hidden = hidden_states.sum(dtype=accumulate_dtype(hidden_states.dtype))
        screen = hidden if screen is None else screen + hidden
    if screen is not None:
        probes["finite"] = screen
    if active is not None:
        probes["active_rows"] = _count_of(active)
    if not probes:
        return None
    read = _read(probes)
    screened = math.isfinite(read.get("finite", 0))
    if read.get("cu_seqlens", 0) != 0:
        _raise_cu_seqlens(layout.cu_seqlens, layout.tokens)
    if read.get("mask", 0) != 0:
        raise ValueError("response_mask must contain only 0 and 1")
    if not screened and per_token:
        flat_mask = layout.flat(response_mask)
        masked_out = ~flat_mask if flat_mask.dtype == torch.bool else flat_mask == 0
        for name, values in per_token.items():
            if bool(_nonfinite_at(layout.flat(values), masked_out)):
                raise ValueError(f"{name} contain NaN or inf at response tokens")
    for name, values in per_response.items():
        if name + "_min" in read:
            finite = math.isfinite(read[name + "_min"]) and math.isfinite(read[name + "_max"])
        else:
            finite = screened or bool(torch.isfinite(values).all())
        if not finite:
            raise ValueError(f"{name} contain NaN or inf")
    if hadw and not (read.get("rewards_min", 0) >= 0 and read.get("rewards_max", 1) <= 1):
        raise ValueError(
            "rewards must lie in [0, 1] with HA-DW (the anchor is a belief about an accuracy); "
            "scale them into [0, 1], or pass anchor=None"
        )
    if "anchor" in read and not 0 <= read["anchor"] <= 1:
        raise ValueError(f"anchor must be finite and in [0, 1], got {anchor}")
    if read.get("rollout_nan", 0) != 0:
        raise ValueError("rollout_logprobs contain NaN at response tokens (a token the engine did not score: "
                         "pass old_logprobs there, which gives it weight 1)")
    if read.get("rollout_positive", 0) != 0:
        raise ValueError("rollout_logprobs must be log-probabilities (<= 0) at response tokens")
    if read.get("entropy", 0) != 0:
        raise ValueError("entropy must be finite and non-negative at response tokens")
    if linear is not None:
        if read["labels"] != 0:
            _raise_label_range(vocab, ignore_index)
        if not screened:
            _check_hidden_at(hidden_states, active_rows(labels, ignore_index))
    return None if active is None else int(read["active_rows"])


def _out_of_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    return ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)


def _raise_label_range(vocab: int, ignore_index: int):
    raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index} at response tokens "
                     "(checked on every call, also with check_values=False: stricter than verl and TRL, whose "
                     "gather does not check)")


def check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int, *, active=None) -> int | None:
    """Labels index the vocabulary or equal ignore_index (one host read: a sync on CUDA),
    the read counting the ``active`` rows too (as :func:`linear_batch`'s): returns
    that count, or None without ``active``."""
    probes = {"labels": _out_of_range(labels, vocab, ignore_index).any()}
    if active is not None:
        probes["active_rows"] = _count_of(active)
    read = _read(probes)
    if read["labels"]:
        _raise_label_range(vocab, ignore_index)
    return None if active is None else int(read["active_rows"])


def assert_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The label check of calls that read no value (``check_values=False``, compiled
    calls): an asynchronous assert, which raises here on the CPU and as a device-side
    assert at the GPU's next synchronisation. Always run: an unchecked label outside the
    vocabulary gives a NaN log-prob (verl and TRL gather without a check)."""
    if labels.numel() == 0:
        return
    valid = ~_out_of_range(labels, vocab, ignore_index).any()
    if labels.device.type == "cpu" and not torch.compiler.is_compiling():
        try:
            torch._assert_async(valid, "labels outside the vocabulary")
        except RuntimeError:
            _raise_label_range(vocab, ignore_index)
    else:
        torch._assert_async(valid, f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}")


def check_temperature(temperature) -> None:
    check_finite_positive("temperature", temperature)


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
    _require_tensor("hidden_states", hidden_states)
    _require_tensor("lm_head_weight", lm_head_weight)
    _require_tensor("labels", labels)
    if layout is None:
        if hidden_states.dim() < 2:
            raise ValueError(f"hidden_states must be [..., H] (e.g. [B, T, H] or [N, H]), got {_shape(hidden_states)}")
        if _shape(labels) != _shape(hidden_states)[:-1]:
            raise ValueError(f"labels must be hidden_states' shape without H, {_shape(hidden_states)[:-1]}, got "
                             f"{_shape(labels)}")
    elif not layout.is_packed:
        if _shape(hidden_states)[:-1] != layout.shape or hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [B, T, H] with [B, T] = {layout.shape} (response_mask's "
                             f"shape), got {_shape(hidden_states)}")
        _require_layout_shape("labels", labels, layout)
    else:
        if hidden_states.dim() not in (2, 3) or _shape(hidden_states)[:-1] not in ((layout.tokens,), (1, layout.tokens)):
            raise ValueError(
                f"hidden_states has shape {_shape(hidden_states)}, but this call is packed (cu_seqlens given): "
                f"they are [N, H] or [1, N, H] with N = {layout.tokens}"
            )
        _require_layout_shape("labels", labels, layout)
    if lm_head_weight.dim() != 2:
        raise ValueError(f"lm_head_weight must be [V, H], got shape {_shape(lm_head_weight)}")
    if lm_head_weight.shape[0] == 0:
        raise ValueError("lm_head_weight has an empty vocabulary")
    _require_float("hidden_states", hidden_states)
    _require_float("lm_head_weight", lm_head_weight)
    if lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(
            f"lm_head_weight is [V, H] = {_shape(lm_head_weight)} but hidden_states have "
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
        _require_tensor("lm_head_bias", lm_head_bias)
        if _shape(lm_head_bias) != (lm_head_weight.shape[0],):
            raise ValueError(f"lm_head_bias must be [V] = [{lm_head_weight.shape[0]}], got {_shape(lm_head_bias)}")
        if lm_head_bias.dtype != lm_head_weight.dtype:
            raise TypeError(f"lm_head_bias ({lm_head_bias.dtype}) must share the LM head's dtype ({lm_head_weight.dtype})")
    check_temperature(temperature)
    devices = {hidden_states.device, lm_head_weight.device, labels.device}
    if len(devices) > 1:
        raise ValueError(f"hidden_states, lm_head_weight and labels must be on one device, got {devices}")
    require_values_device("hidden_states", hidden_states.device)


def _check_hidden_at(hidden_states: torch.Tensor, active: torch.Tensor) -> None:
    """``hidden_states`` [N, H] finite at the ``active`` [N] rows."""
    if bool(_nonfinite_at(hidden_states, ~active[:, None])):
        raise ValueError("hidden_states contain NaN or inf at response tokens")
