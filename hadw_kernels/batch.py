"""One call's batch: what validation leaves of a call to the losses (``validation.py``
checks the call and returns it, built here by :func:`build_batch` for both losses), the
one object every later hop takes (the correction rules, the backends, the reference). The
kernel backends flatten it into the ops' arguments in one place
(``backends/kernel_backend.op_arguments``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .active_rows import RowSelection
from .aggregation_table import AGGREGATIONS
from .config import LossConfig
from .layout import TokenLayout


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
    (``objectives.SELECTIONS``; None: none). ``with_metrics``: whether the call returns
    its metrics (a backend may skip forming them otherwise).
    ``rollout_logprobs``, ``mask_entropy``, ``generator``: what the correction rules and
    token selections read before the op (``loss._corrected_surrogate``), not the op:
    the rollout engine's log-probs [N], the entropies the entropy mask ranks [N] (the
    caller's, or those the linear loss formed) and the draw's generator."""

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

    def replace(self, **changes) -> "SurrogateBatch":
        return dataclasses.replace(self, **changes)


def build_batch(
    layout: TokenLayout,
    config: LossConfig,
    logprobs: torch.Tensor | None,
    old_logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    rewards: torch.Tensor | None,
    advantages: torch.Tensor | None,
    anchor: float | torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    importance_weights: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    generator: torch.Generator | None,
    with_metrics: bool,
) -> SurrogateBatch:
    """The batch of a validated call of either loss, its tensors as the caller gave them
    (``logprobs`` None in the linear loss): per-token ones flat on ``layout``, the
    behaviour log-probs of an on-policy call the detached current ones (the linear loss
    sets them after its sweep), the reference log-probs kept only where a KL term reads
    them, per-response importance weights repeated per token, and ``config``'s constant
    L of a ``times_max_length`` aggregation resolved: a padded batch's default is its
    width (a packed one has none: validation asks for L), so the kernels, which see flat
    tokens, always receive it. ``entropy``: what the entropy mask ranks."""
    if config.max_response_length is None and AGGREGATIONS[config.loss_agg_mode].times_max_length:
        config = dataclasses.replace(config, max_response_length=max(layout.padded_width, 1))
    logprobs, old_logprobs = layout.flat(logprobs), layout.flat(old_logprobs)
    if old_logprobs is None and logprobs is not None:
        old_logprobs = logprobs.detach()
    return SurrogateBatch(
        layout, config, logprobs, old_logprobs, layout.flat(response_mask), rewards=rewards,
        **caller_advantages(layout, advantages), anchor=anchor,
        ref_logprobs=layout.flat(ref_logprobs) if config.beta > 0 else None,
        importance_weights=layout.per_token(importance_weights), with_metrics=with_metrics,
        rollout_logprobs=layout.flat(rollout_logprobs), mask_entropy=layout.flat(entropy), generator=generator,
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
    are formed. Built by validation (``validation.linear_batch``) with the call's batch."""

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
