"""The aggregation modes as rows of one table (:data:`AGGREGATIONS`): how per-token values
become the loss (verl's ``loss_agg_mode``). ``aggregation.py`` applies a row; the C++
header that setup.py generates and the Triton kernels read the same rows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Aggregation:
    """How an aggregation mode turns per-token values v of valid tokens into the loss:
    sum_i w_i sum_t v_it, with each valid token of response i weighed

        w_i = 1 / (count x (T_i if per_response_mean) x (L if times_max_length))

    ``count`` names the call's own count that a ``loss_normalizer`` replaces by the
    whole rollout batch's: "tokens" (N, the valid tokens), "responses" (S, the rows),
    or "one" (1: no count; a normaliser still divides). T_i is response i's valid
    tokens (at least 1), L the constant max_response_length (default: the mask width).
    Every backend reads this table (docs/math.md, section 5b)."""

    count: str
    per_response_mean: bool = False
    times_max_length: bool = False

    def __post_init__(self) -> None:
        if self.count not in AGGREGATION_COUNTS:
            raise ValueError(f"an aggregation counts one of {AGGREGATION_COUNTS}, got {self.count!r}")


AGGREGATION_COUNTS = ("tokens", "responses", "one")
AGGREGATIONS = {
    "token-mean": Aggregation(count="tokens"),  # DAPO, TRL's bnpo/dapo
    "seq-mean-token-mean": Aggregation(count="responses", per_response_mean=True),  # GRPO
    "seq-mean-token-sum": Aggregation(count="responses"),
    "seq-mean-token-sum-norm": Aggregation(count="responses", times_max_length=True),  # Dr.GRPO
    "token-sum": Aggregation(count="one"),  # verl's token-sum
}
AGG_MODES = tuple(AGGREGATIONS)


def counts_batch_tokens(loss_agg_mode: int, loss_normalizer: float | None) -> bool:
    """Whether the aggregation of ``loss_agg_mode`` (its index in :data:`AGG_MODES`,
    as the ops take it) divides by the batch's count of valid tokens: token-mean without
    ``loss_normalizer``. The kernels form that count in the launch that writes the
    gradients, which therefore leave its 1 / N_tok to the ops' ``grad_scale``
    (ops/schemas.py)."""
    return AGGREGATIONS[AGG_MODES[loss_agg_mode]].count == "tokens" and loss_normalizer is None
