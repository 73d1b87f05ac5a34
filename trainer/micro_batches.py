"""Cutting a mini-batch's responses into micro-batches (one forward and backward each).

The advantages are formed once per rollout batch, so a micro-batch is any set of
responses: it need not hold whole groups. By a token budget (``train.micro_batch_tokens``)
the responses are sorted by length and packed greedily while the micro-batch, as it is
fed to the model, holds at most the budget: packed (``train.packing``), the sum of the
samples' prompt + response tokens; padded, rows x (widest prompt + widest response),
since prompts are left-padded and responses right-padded to a common width. Memory is
then set by the budget, not by the group size. With no budget, each micro-batch holds
``train.micro_batch_prompts`` prompts' responses, in order.

Every rank must run the same number of forwards (ZeRO-3 gathers parameters inside each
one), so the trainer agrees on the largest count over the ranks and each rank splits its
largest micro-batches until it has that many (:func:`split_to_count`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hadw_kernels.config import AGGREGATIONS


def padded_tokens(rows: Sequence[int], prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> int:
    """Tokens of the rows as fed to the model padded: every row padded to the widest
    prompt and the widest response (at least one response position)."""
    if not rows:
        return 0
    prompt_width = max(prompt_lengths[row] for row in rows)
    response_width = max(1, max(response_lengths[row] for row in rows))
    return len(rows) * (prompt_width + response_width)


def packed_tokens(rows: Sequence[int], prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> int:
    """Tokens of the rows as fed to the model packed: every prompt and response token, no padding."""
    return sum(prompt_lengths[row] + response_lengths[row] for row in rows)


class _Tally:
    """A growing micro-batch's tokens as fed to the model, packed or padded."""

    def __init__(self, packed: bool) -> None:
        self.packed = packed
        self.rows = self.total = self.prompt_width = self.response_width = 0

    def with_row(self, prompt: int, response: int) -> int:
        """The tokens once a row of these lengths joins."""
        if self.packed:
            return self.total + prompt + response
        return (self.rows + 1) * (max(self.prompt_width, prompt) + max(self.response_width, response, 1))

    def add(self, prompt: int, response: int) -> None:
        self.rows += 1
        self.total += prompt + response
        self.prompt_width = max(self.prompt_width, prompt)
        self.response_width = max(self.response_width, response, 1)


def pack_by_tokens(rows: Sequence[int], prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                   budget: int, *, packed: bool = False) -> tuple[list[list[int]], list[int]]:
    """(micro-batches, rows over the budget): ``rows`` sorted by response then prompt
    length and packed greedily under ``budget`` tokens, counted packed or padded. A row
    longer than the budget on its own gets a micro-batch of its own and is listed second."""
    if budget < 1:
        raise ValueError(f"a token budget must be positive, got {budget}")
    ordered = sorted(rows, key=lambda row: (response_lengths[row], prompt_lengths[row], row))
    micro_batches: list[list[int]] = []
    oversized: list[int] = []
    current: list[int] = []
    tally = _Tally(packed)
    for row in ordered:
        prompt, response = prompt_lengths[row], response_lengths[row]
        if current and tally.with_row(prompt, response) > budget:
            micro_batches.append(current)
            current, tally = [], _Tally(packed)
        if not current and tally.with_row(prompt, response) > budget:
            oversized.append(row)
        current.append(row)
        tally.add(prompt, response)
    if current:
        micro_batches.append(current)
    return micro_batches, oversized


def split_to_count(micro_batches: list[list[int]], count: int, prompt_lengths: Sequence[int],
                   response_lengths: Sequence[int], *, packed: bool = False) -> list[list[int]]:
    """``micro_batches`` split until there are ``count``: each time the one with the most
    tokens (of those with two rows or more) into two halves. Splitting keeps every
    micro-batch within the budget it was packed under."""
    tokens = packed_tokens if packed else padded_tokens
    result = [list(micro) for micro in micro_batches]
    total_rows = sum(len(micro) for micro in result)
    if count > total_rows:
        raise ValueError(f"cannot cut {total_rows} responses into {count} micro-batches")
    while len(result) < count:
        largest = max((micro for micro in result if len(micro) > 1),
                      key=lambda micro: tokens(micro, prompt_lengths, response_lengths))
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
    count the mode divides by (its row of ``config.AGGREGATIONS``)."""
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
