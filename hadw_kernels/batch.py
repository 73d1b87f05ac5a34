"""One call's batch: what validation leaves of a call to the losses, the one object every
later hop takes (the correction rules, the backends, the reference)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .active_rows import RowSelection
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
    its metrics (a backend may skip forming them otherwise)."""

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

    def replace(self, **changes) -> "SurrogateBatch":
        return dataclasses.replace(self, **changes)


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
    are formed."""

    hidden_states: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    temperature: float
    ignore_index: int
    block_rows: int | None
    rows: RowSelection
