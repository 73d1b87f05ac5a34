"""The value checks: every value a call's checks read (finite log-probs at response
tokens, finite rewards, rewards and anchor in [0, 1] under HA-DW, a 0/1 mask, offsets,
labels in the vocabulary, the linear loss's count of active rows) formed by a few
reductions and read in one host synchronisation (docs/architecture.md, "Host
synchronisation"); a failure is then named by a precise check of its own. The calls that
read no value (``check_values=False``, compiled calls) still check the offsets and labels,
whose faults would read outside a tensor, with asynchronous asserts.
"""

from __future__ import annotations

import math

import torch

from ..batch.active_rows import active_rows
from ..batch.token_layout import TokenLayout
from ..tables.bounds import check_finite_positive, compiling
from ..tables.precision import accumulate_dtype
from .arguments import check_anchor, detached, require_values_device


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
    if cu_seqlens.device.type == "cpu" and not compiling():
        try:
            torch._assert_async(valid, "cu_seqlens")
        except RuntimeError:
            _raise_cu_seqlens(cu_seqlens, layout.tokens)
    else:
        torch._assert_async(valid, f"cu_seqlens must start at 0, end at N = {layout.tokens} and never decrease")


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
    check_values(None, None, {"rewards": rewards}, anchor=anchor)


def check_prior(scope: str, name: str, prior, rewards: torch.Tensor) -> None:
    """``prior`` as estimator ``name`` of ``scope`` (tables.estimators.SCOPES) takes it:
    the history's estimator needs the [B, 2] floating pseudo-counts PromptHistory.update
    returns, on the rewards' device; every other estimator none. No host read."""
    if scope != "history":
        if prior is not None:
            raise ValueError(f"prior is read by the history estimators only, not estimator={name!r}")
        return
    if prior is None:
        raise ValueError(f"estimator={name!r} needs prior: the [B, 2] pseudo-counts PromptHistory.update returns")
    if not isinstance(prior, torch.Tensor) or not prior.is_floating_point():
        raise TypeError("prior must be a floating-point tensor [B, 2] (PromptHistory.update's)")
    if tuple(prior.shape) != (rewards.numel(), 2) or prior.device != rewards.device:
        raise ValueError(f"prior must be [{rewards.numel()}, 2] on {rewards.device}, got {tuple(prior.shape)} "
                         f"on {prior.device}")


def check_prior_values(prior: torch.Tensor, rewards: torch.Tensor, dense: torch.Tensor, groups: int) -> None:
    """The pseudo-counts finite, non-negative and not both 0, alike within each group (a
    group's responses share their prompt: rows that differ were read for other prompts,
    keys out of step with the rewards' order), and the rewards in [0, 1] (the prior counts
    successes). One host read."""
    low = torch.full((groups, 2), math.inf, dtype=prior.dtype, device=prior.device).scatter_reduce_(
        0, dense[:, None].expand(-1, 2), prior, "amin")
    high = torch.full_like(low, -math.inf).scatter_reduce_(0, dense[:, None].expand(-1, 2), prior, "amax")
    faults = torch.stack([
        ~torch.isfinite(prior).all() | (prior < 0).any() | ~(prior.sum(1) > 0).all(),
        (low != high).any(),
        ((rewards < 0) | (rewards > 1)).any(),
    ]).tolist()
    if faults[0]:
        raise ValueError("prior's pseudo-counts must be finite, non-negative and not both 0")
    if faults[1]:
        raise ValueError("prior's rows differ within a group: a group's responses share their prompt's pseudo-counts "
                         "(PromptHistory.update's rows, in the rewards' order)")
    if faults[2]:
        raise ValueError("rewards must lie in [0, 1] with a prompt history: its prior counts successes")


def check_group_index(group_index: torch.Tensor, group_size: int) -> None:
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


def _layout_of(layout: TokenLayout | None) -> TokenLayout:
    """The layout a per-token check reads: :func:`check_values` takes None only for a call
    without per-token tensors (``check_advantage_options``' rewards), which reaches no such
    check."""
    if layout is None:
        raise ValueError("per-token tensors are checked in their batch's layout: check_values needs one")
    return layout


def check_values(layout: TokenLayout | None, response_mask, inputs: dict[str, torch.Tensor], *, anchor,
                  linear=None, correction=(None, None), active=None) -> int | None:
    """Every check from a few reductions read in one host synchronisation; a failure is
    then named by a precise check of its own. At 16k tokens on the CPU the checks cost as
    much as the loss did: each reduction here is one op, or two passes over the tokens.
    ``layout``: the batch's (its offsets join the read when packed), None without
    per-token tensors. ``inputs``: the float tensors the loss reads (``validation.read_inputs``),
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
    for name, given in inputs.items():
        values = detached(given)
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
        token_values = list(per_token.values())
        if layout is not None and any(other.shape != token_values[0].shape for other in token_values[1:]):
            token_values = [layout.flat(other) for other in token_values]  # [B, T], [N] and [1, N] may come mixed
        combined = token_values[0]
        for sign, other in enumerate(token_values[1:]):
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
        token_layout = _layout_of(layout)
        counted = token_layout.flat(response_mask) != 0
        rollout_logprobs, entropy = token_layout.flat(rollout_logprobs), token_layout.flat(entropy)
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
        token_layout = _layout_of(layout)
        _raise_cu_seqlens(token_layout.cu_seqlens, token_layout.tokens)
    if read.get("mask", 0) != 0:
        raise ValueError("response_mask must contain only 0 and 1")
    if not screened and per_token:
        token_layout = _layout_of(layout)
        flat_mask = token_layout.flat(response_mask)
        masked_out = ~flat_mask if flat_mask.dtype == torch.bool else flat_mask == 0
        for name, values in per_token.items():
            if bool(_nonfinite_at(token_layout.flat(values), masked_out)):
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
    the read counting the ``active`` rows too (as ``validation.linear_batch``'s): returns
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
    if labels.device.type == "cpu" and not compiling():
        try:
            torch._assert_async(valid, "labels outside the vocabulary")
        except RuntimeError:
            _raise_label_range(vocab, ignore_index)
    else:
        torch._assert_async(valid, f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}")


def _check_hidden_at(hidden_states: torch.Tensor, active: torch.Tensor) -> None:
    """``hidden_states`` [N, H] finite at the ``active`` [N] rows."""
    if bool(_nonfinite_at(hidden_states, ~active[:, None])):
        raise ValueError("hidden_states contain NaN or inf at response tokens")
