"""The aggregation of per-token values into the loss, by ``config.loss_agg_mode``'s row of
:data:`tables.aggregations.AGGREGATIONS` (docs/math.md, section 5b): the weight w_i of each response's
valid tokens. The reference, the linear loss's bias-corrected KL and the kernels' callers
(which hand w to the kernels) all take it from here."""

from __future__ import annotations

import torch

from ..batch.token_layout import TokenLayout
from ..config.loss_config import LossConfig
from ..tables.aggregations import AGGREGATIONS


def aggregate(values: torch.Tensor, mask: torch.Tensor, layout: TokenLayout, config: LossConfig) -> torch.Tensor:
    """Reduces per-token values [N] to the loss by ``config.loss_agg_mode``:
    sum_i w_i sum_t v_it over the valid tokens of each segment, w from :func:`agg_weights`."""
    sums = layout.segment_sum(torch.where(mask, values, torch.zeros_like(values)))
    return (sums * agg_weights(mask, layout, config).to(sums.dtype)).sum()


def agg_weights(mask: torch.Tensor, layout: TokenLayout, config: LossConfig) -> torch.Tensor:
    """w_i [S]: the weight of each valid token of response i, by the mode's row of
    :data:`tables.aggregations.AGGREGATIONS`. Float64, for the kernels that take it. The constant L of
    ``times_max_length`` is ``config.max_response_length``, which the losses resolve
    (the mask width of a padded batch by default)."""
    rule = AGGREGATIONS[config.loss_agg_mode]
    lengths = layout.segment_sum(mask).to(torch.float64)
    if rule.count == "tokens":
        count = config.loss_normalizer or lengths.sum().clamp(min=1)
    elif rule.count == "responses":
        count = config.loss_normalizer or max(layout.segments, 1)
    elif rule.count == "one":
        count = config.loss_normalizer or 1
    else:
        raise ValueError(f"aggregation count {rule.count!r} has no meaning here")
    weights = torch.ones_like(lengths) / count
    if rule.per_response_mean:
        weights = weights / lengths.clamp(min=1)
    if rule.times_max_length:
        if config.max_response_length is None:  # the losses resolve it first (batch.build_batch)
            raise ValueError(f"loss_agg_mode={config.loss_agg_mode!r} needs max_response_length")
        weights = weights / config.max_response_length
    return weights
