"""One call's inputs and its batch: :class:`CallInputs` (and the linear loss's
:class:`LinearInputs`), a call's tensors as the caller gave them, which validation takes
as one object (``validation.py``), and what validation leaves of them: the batch, built
here by :func:`build_batch` for both losses, and the linear loss's head
(:func:`build_head`), the objects every later hop takes (the correction rules, the
backends, the reference). The kernel backends flatten them into the ops' arguments in one
place (``backends/kernel_backend.op_arguments``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config.loss_config import LossConfig
from ..tables.aggregations import AGGREGATIONS
from .active_rows import RowSelection
from .token_layout import TokenLayout


@dataclass(slots=True)
class CallInputs:
    """The tensors of one call of either loss as the caller passed them, before any check
    (the losses' arguments of the same names): per-token ones [B, T] padded, [N] or
    [1, N] packed with ``cu_seqlens``; ``logprobs`` None in the linear loss, ``entropy``
    (what the entropy mask ranks) the surrogate loss's only."""

    logprobs: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    response_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    group_index: torch.Tensor | None = None
    anchor: float | torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    generator: torch.Generator | None = None
    batch_totals: torch.Tensor | None = None
    prior: torch.Tensor | None = None


@dataclass(slots=True)
class LinearInputs:
    """The linear loss's own arguments: the hidden states, the LM head and the labels as
    the caller passed them, and how the logits are formed and swept."""

    hidden_states: torch.Tensor
    lm_head_weight: torch.Tensor
    labels: torch.Tensor
    lm_head_bias: torch.Tensor | None
    temperature: float
    ignore_index: int
    block_rows: int | None


@dataclass(slots=True)
class SurrogateBatch:
    """The surrogate's inputs for one call, flat: per-token tensors [N] in ``layout``'s
    segments (one response each), per-response ones [S], and what the call returns.

    ``logprobs``: None in the linear loss until its sweep forms them, ``old_logprobs``
    None there for an on-policy call (they are then the log-probs formed).
    ``advantages``: the caller's per token, or ``response_advantages`` theirs per response
    [S], which the kernels read without repeating them over the tokens (both None: formed
    from ``rewards``).
    ``importance_weights``: per token (a per-response weight repeated over its tokens).
    ``entropy``: the entropy the op takes, with its gradient (the linear loss's bonus and
    metric). ``selected``: the tokens an objective's batch statistic selected
    (the objective's row's ``selection``; None: none). ``with_metrics``: whether the call returns
    its metrics (a backend may skip forming them otherwise).
    ``rollout_logprobs``, ``mask_entropy``, ``generator``: what the correction rules and
    token selections read before the op (``loss._corrected_surrogate``), not the op:
    the rollout engine's log-probs [N], the entropies the entropy mask ranks [N] (the
    caller's, or those the linear loss formed) and the draw's generator.
    ``batch_totals``: the whole rollout batch's sums that ``james_stein`` reads
    (``advantage.batch_totals``; None: the call's groups are the batch). ``prior``: each
    response's pseudo-counts (alpha, beta) [S, 2] that ``prompt_history`` reads
    (``PromptHistory.update``'s)."""

    layout: TokenLayout
    config: LossConfig
    logprobs: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    mask: torch.Tensor
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    response_advantages: torch.Tensor | None = None
    anchor: float | torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    with_metrics: bool = True
    rollout_logprobs: torch.Tensor | None = None
    mask_entropy: torch.Tensor | None = None
    generator: torch.Generator | None = None
    batch_totals: torch.Tensor | None = None
    prior: torch.Tensor | None = None

    def replace(self, **changes) -> "SurrogateBatch":
        return dataclasses.replace(self, **changes)

    def current_logprobs(self) -> torch.Tensor:
        """``logprobs``, as what reads the current policy takes them: the surrogate op,
        the token selections and the rules that read the current policy, every one of
        which runs once they are formed (the linear loss's sweep forms them; the
        surrogate loss is given them). Raises where they are not formed yet."""
        if self.logprobs is None:
            raise ValueError("the batch's log-probs are read before they are formed (the linear loss forms them "
                             "in its sweep)")
        return self.logprobs

    def behaviour_logprobs(self) -> torch.Tensor:
        """``old_logprobs``, as the surrogate op and the correction rules take them: the
        caller's, or an on-policy call's current ones (:func:`build_batch` sets them for
        the surrogate loss, the linear loss after its sweep). Raises where they are not
        set yet."""
        if self.old_logprobs is None:
            raise ValueError("the batch's behaviour log-probs are read before they are set (an on-policy call of "
                             "the linear loss takes them from its sweep)")
        return self.old_logprobs


def build_batch(layout: TokenLayout, config: LossConfig, call: CallInputs, *, with_metrics: bool) -> SurrogateBatch:
    """The batch of a validated ``call`` of either loss, its tensors as the caller gave them
    (``logprobs`` None in the linear loss): per-token ones flat on ``layout``, the
    behaviour log-probs of an on-policy call the detached current ones (the linear loss
    sets them after its sweep), the reference log-probs kept only where a KL term reads
    them, per-response importance weights repeated per token, and ``config``'s constant
    L of a ``times_max_length`` aggregation resolved: a padded batch's default is its
    width (a packed one has none: validation asks for L), so the kernels, which see flat
    tokens, always receive it. ``call.entropy``: what the entropy mask ranks."""
    if config.max_response_length is None and AGGREGATIONS[config.loss_agg_mode].times_max_length:
        if layout.padded_width is None:  # check_batch_inputs refuses this call first
            raise ValueError(f"loss_agg_mode={config.loss_agg_mode!r} in a packed batch needs max_response_length")
        config = dataclasses.replace(config, max_response_length=max(layout.padded_width, 1))
    logprobs, old_logprobs = layout.flat(call.logprobs), layout.flat(call.old_logprobs)
    if old_logprobs is None and logprobs is not None:
        old_logprobs = logprobs.detach()
    return SurrogateBatch(
        layout, config, logprobs, old_logprobs, layout.flat(call.response_mask), rewards=call.rewards,
        **caller_advantages(layout, call.advantages), anchor=call.anchor,
        ref_logprobs=layout.flat(call.ref_logprobs) if config.beta > 0 else None,
        importance_weights=layout.per_token(call.importance_weights), with_metrics=with_metrics,
        rollout_logprobs=layout.flat(call.rollout_logprobs), mask_entropy=layout.flat(call.entropy),
        generator=call.generator, batch_totals=call.batch_totals, prior=call.prior,
    )


def caller_advantages(layout: TokenLayout, advantages: torch.Tensor | None) -> dict:
    """The caller's advantages as a :class:`SurrogateBatch` holds them: per token [N], or
    per response [S] as given (the kernels read those per response: repeating them over
    the tokens was a copy in every call)."""
    if layout.is_per_response(advantages):
        return {"advantages": None, "response_advantages": advantages}
    return {"advantages": layout.flat(advantages), "response_advantages": None}


@dataclass(slots=True)
class LinearHead:
    """The linear loss's head and the rows it sweeps: ``hidden_states`` as the caller gave
    them (the gradient's shape), ``hidden`` the swept rows [R, H] and their ``labels`` [R]
    (ignored where the loss counts no token), ``rows`` which of the N rows they are (every
    row, or the active ones: active_rows.py), the LM head, its bias and how the logits
    are formed. Built by :func:`build_head` with the call's batch."""

    hidden_states: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    temperature: float
    ignore_index: int
    block_rows: int | None
    rows: RowSelection

    def replace(self, **changes) -> "LinearHead":
        return dataclasses.replace(self, **changes)


def flat_labels(layout: TokenLayout, batch: SurrogateBatch, linear: LinearInputs) -> torch.Tensor:
    """The labels [N], ignored where the batch counts no token (padding, a prompt): such
    rows are inactive (active_rows.py), and their labels are never checked or read."""
    return layout.flat(linear.labels).masked_fill(~batch.mask.bool(), linear.ignore_index)


def build_head(linear: LinearInputs, hidden: torch.Tensor, labels: torch.Tensor, rows: RowSelection) -> LinearHead:
    """The head of a validated call of the linear loss: its hidden states flat [N, H]
    (``hidden``) and labels [N] (:func:`flat_labels`) taken at ``rows``, the rows its sweep
    runs over."""
    return LinearHead(linear.hidden_states, rows.take(hidden), linear.lm_head_weight, linear.lm_head_bias,
                      rows.take(labels), linear.temperature, linear.ignore_index, linear.block_rows, rows)
