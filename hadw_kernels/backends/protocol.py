"""What a backend is: the contract every module in ``backends/`` satisfies with its
``BACKEND`` object, and the losses (``loss.py``) rely on. A static description
(``typing.Protocol``): tests/conformance checks each registered backend against it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from ..batch.inputs import LinearHead, SurrogateBatch

# (loss, metrics by name): the metrics that apply to the call, ``metrics.METRIC_NAMES`` order.
LossAndMetrics = tuple[torch.Tensor, dict[str, torch.Tensor]]


class LinearSurrogate(Protocol):
    """The gradients-in-forward linear loss of a token-level surrogate: per-row log-probs
    [N], entropy [N], and the gradients with respect to the hidden states, the head and
    the bias, from one sweep over blocks of rows (docs/architecture.md, "The linear loss").
    ``batch`` holds the call's per-token data (its log-probs are what the sweep forms, its
    ``advantages`` each token's); ``agg_weights`` are each token's aggregation weight.
    Every per-token tensor and the outputs are over ``head``'s rows: the N rows, or the
    active ones where the loss selected them (``head.hidden``; ``batch``'s layout stays
    the call's)."""

    def __call__(
        self, head: LinearHead, batch: SurrogateBatch, agg_weights: torch.Tensor, with_entropy: bool,
    ) -> tuple[torch.Tensor, ...]: ...


@runtime_checkable
class Backend(Protocol):
    name: str
    # The gradients-in-forward linear loss, or None where the backend has none.
    linear_surrogate: LinearSurrogate | None
    # How gradients formed in the forward are scaled in place by the upstream gradient
    # (``ops.attach_single_use_gradients``); None: ``Tensor.mul_``.
    scale_in_place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    # Whether its linear kernels leave the rows whose label is ignored out of their GEMMs
    # themselves (the C++ ones, on the CPU); otherwise the loss selects the active rows
    # where its value checks count them (active_rows.py).
    compacts_rows: bool

    def serves(self, device: torch.device) -> bool:
        """Whether this backend runs on tensors of ``device`` here."""
        ...

    def unavailable_message(self, device: torch.device) -> str:
        """Why it does not (for ``BackendUnavailable``)."""
        ...

    def has_gradients_in_forward(self, device: torch.device) -> bool:
        """Whether ``linear_surrogate`` runs on ``device``."""
        ...

    def surrogate_loss(self, batch: SurrogateBatch) -> LossAndMetrics:
        """The clipped surrogate of ``batch.config`` on the call's flat tensors
        (:class:`~hadw_kernels.batch.inputs.SurrogateBatch`), differentiable with respect to its
        log-probs and entropy, and its metrics when ``batch.with_metrics``; inputs are
        already validated."""
        ...

    def token_logprobs(
        self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, *,
        lm_head_bias: torch.Tensor | None, temperature: float, ignore_index: int, with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs [N], entropy [N] or None) of ``labels`` under softmax(h W^T + b) / T,
        differentiable with respect to the hidden states, the head and the bias, without a
        [N, V] tensor."""
        ...
