"""Cutting a mini-batch's responses into micro-batches (one forward and backward each).

The advantages are formed once per rollout batch, so a micro-batch is any set of
responses: it need not hold whole groups. By a token budget (``train.micro_batch_tokens``)
the responses are sorted by length and packed greedily while the micro-batch, as it is
fed to the model in the run's layout (``hadw_kernels.layouts``, whose ``tally`` counts
it), holds at most the budget; where the layout shares prompts, a group is kept whole
where it fits. Memory is then set by the budget, not by the group size. With no budget,
each micro-batch holds ``train.micro_batch_prompts`` prompts' responses, in order (whole
groups).

Every rank must run the same number of forwards (ZeRO-3 gathers parameters inside each
one), so the trainer agrees on the largest count over the ranks and each rank splits its
largest micro-batches until it has that many (:func:`split_to_count`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hadw_kernels.layouts import LAYOUTS, Layout, RowTokens
from hadw_kernels.tables.aggregations import AGGREGATIONS


def _ordered(rows: Sequence[int], batch: RowTokens, layout: Layout) -> list[list[int]]:
    """The rows in the order they are packed, as runs that stay together where they fit:
    single rows by response then prompt length (padding stays small); where the layout
    shares prompts, each group's rows, groups in their prompts' token order and rows in
    their responses' (so that runs a prefix tree shares, a system prompt common to every
    prompt or responses that begin alike, fall in one micro-batch where they fit)."""
    prompt_lengths, response_lengths = batch.prompt_lengths, batch.response_lengths
    if not layout.shares_prompts:
        return [[row] for row in sorted(rows, key=lambda row: (response_lengths[row], prompt_lengths[row], row))]
    members: dict[int, list[int]] = {}
    for row in rows:
        members.setdefault(batch.groups[row], []).append(row)
    return [sorted(group_rows, key=lambda row: (batch.responses[row], row))
            for _, group_rows in sorted(members.items(), key=lambda item: (batch.prompts[item[1][0]], item[0]))]


def pack_by_tokens(rows: Sequence[int], batch: RowTokens, budget: int, *,
                   layout: Layout = LAYOUTS["padded"]) -> tuple[list[list[int]], list[int]]:
    """(micro-batches, rows over the budget): ``rows`` of ``batch`` packed greedily under
    ``budget`` tokens as fed to the model in ``layout`` (its ``tally``). A group of a
    layout that shares prompts stays in one micro-batch where it fits one, else it is
    split over several, its prompt in each. A row longer than the budget on its own gets
    a micro-batch of its own and is listed second."""
    if budget < 1:
        raise ValueError(f"a token budget must be positive, got {budget}")

    def new_tally():
        return layout.tally(batch)

    micro_batches: list[list[int]] = []
    oversized: list[int] = []
    current: list[int] = []
    tally = new_tally()
    for run in _ordered(rows, batch, layout):
        if current and tally.with_rows(run) > budget and new_tally().with_rows(run) <= budget:
            micro_batches.append(current)  # the run fits a micro-batch of its own: not split
            current, tally = [], new_tally()
        for row in run:
            if current and tally.with_rows([row]) > budget:
                micro_batches.append(current)
                current, tally = [], new_tally()
            if not current and tally.with_rows([row]) > budget:
                oversized.append(row)
            current.append(row)
            tally.add([row])
    if current:
        micro_batches.append(current)
    return micro_batches, oversized


def split_to_count(micro_batches: list[list[int]], count: int, batch: RowTokens, *,
                   layout: Layout = LAYOUTS["padded"]) -> list[list[int]]:
    """``micro_batches`` split until there are ``count``: each time the one with the most
    tokens (of those with two rows or more) into two halves. Splitting keeps every
    micro-batch within the budget it was packed under: in every layout a subset of a
    micro-batch's rows costs no more tokens than the whole."""
    result = [list(micro) for micro in micro_batches]
    total_rows = sum(len(micro) for micro in result)
    if count > total_rows:
        raise ValueError(f"cannot cut {total_rows} responses into {count} micro-batches")
    while len(result) < count:
        largest = max((micro for micro in result if len(micro) > 1),
                      key=lambda micro: layout.fed_tokens(batch, micro))
        index = result.index(largest)
        half = len(largest) // 2
        result[index:index + 1] = [largest[:half], largest[half:]]
    return result


def by_prompt_count(rows: Sequence[int], rows_per_micro_batch: int) -> list[list[int]]:
    """Consecutive runs of ``rows_per_micro_batch`` rows (the no-budget cut)."""
    return [list(rows[start:start + rows_per_micro_batch]) for start in range(0, len(rows), rows_per_micro_batch)]


def loss_normalizer(loss_agg_mode: str, *, batch_tokens: float, mini_batches: int, responses_per_rank: int,
                    world_size: int) -> float:
    """The ``loss_normalizer`` every micro-batch of a mini-batch passes, so that the
    micro-batches' gradients add up to the mini-batch's however it is cut, and the ranks'
    (which DeepSpeed averages) to the whole mini-batch's over all ranks. It replaces the
    count the mode divides by (its row of ``tables.aggregations.AGGREGATIONS``)."""
    if loss_agg_mode not in AGGREGATIONS:
        raise ValueError(f"no micro-batch normaliser for loss_agg_mode {loss_agg_mode!r}")
    count = AGGREGATIONS[loss_agg_mode].count
    if count == "tokens":
        # Every token of the rollout batch (over all ranks) weighs the same in every
        # optimizer step: its tokens shared out over the mini-batches.
        return batch_tokens / (mini_batches * world_size)
    if count == "responses":
        return float(responses_per_rank)
    if count == "one":
        return 1.0 / world_size
    raise ValueError(f"no micro-batch normaliser for the aggregation count {count!r}")
