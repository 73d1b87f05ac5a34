"""Cutting a mini-batch's responses into micro-batches (one forward and backward each).

The advantages are formed once per rollout batch, so a micro-batch is any set of
responses: it need not hold whole groups. By a token budget (``train.micro_batch_tokens``)
the responses are sorted by length and packed greedily while the micro-batch, as it is
fed to the model, holds at most the budget (:class:`Tally` counts each layout): with a
shared prompt (``train.share_prompt``), each group's prompt once and its responses, a
group kept whole where it fits; packed (``train.packing``), the sum of the samples'
prompt + response tokens; padded, rows x (widest prompt + widest response), since
prompts are left-padded and responses right-padded to a common width. Memory is then
set by the budget, not by the group size. With no budget, each micro-batch holds
``train.micro_batch_prompts`` prompts' responses, in order (whole groups).

Every rank must run the same number of forwards (ZeRO-3 gathers parameters inside each
one), so the trainer agrees on the largest count over the ranks and each rank splits its
largest micro-batches until it has that many (:func:`split_to_count`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hadw_kernels.config import AGGREGATIONS


LAYOUTS = ("padded", "packed", "shared_prompt")


class Tally:
    """The tokens of a growing micro-batch as fed to the model in ``layout`` (one of
    ``LAYOUTS``): padded, every row padded to the widest prompt and the widest response
    (at least one response position); packed, every prompt and response token; shared
    prompt (``policy.SharedPromptBatch``), each group's prompt once but its last token
    (whole where the group's responses here are all empty) and every response token.
    Rows r and s share a prompt when r // group_size == s // group_size."""

    def __init__(self, layout: str, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                 group_size: int = 1) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown micro-batch layout {layout!r}; the layouts are {LAYOUTS}")
        self.layout, self.group_size = layout, group_size
        self.prompt_lengths, self.response_lengths = prompt_lengths, response_lengths
        self.rows = self.response_tokens = self.prompt_tokens = self.prompt_width = self.response_width = 0
        self.groups: dict[int, tuple[int, bool]] = {}  # group -> (prompt length, a response here has tokens)

    def _merged_groups(self, rows: Sequence[int]) -> dict[int, tuple[int, bool]]:
        groups = dict(self.groups)
        for row in rows:
            group = row // self.group_size
            has_tokens = groups.get(group, (0, False))[1] or self.response_lengths[row] > 0
            groups[group] = (self.prompt_lengths[row], has_tokens)
        return groups

    def with_rows(self, rows: Sequence[int]) -> int:
        """The tokens once ``rows`` join."""
        responses = [self.response_lengths[row] for row in rows]
        if self.layout == "padded":
            prompt_width = max([self.prompt_width, *(self.prompt_lengths[row] for row in rows)])
            return (self.rows + len(rows)) * (prompt_width + max([self.response_width, 1, *responses]))
        if self.layout == "packed":
            prompts = sum(self.prompt_lengths[row] for row in rows)
            return self.prompt_tokens + self.response_tokens + prompts + sum(responses)
        prompts = sum(length - has_tokens for length, has_tokens in self._merged_groups(rows).values())
        return self.response_tokens + sum(responses) + prompts

    def add(self, rows: Sequence[int]) -> None:
        self.groups = self._merged_groups(rows)
        for row in rows:
            self.rows += 1
            self.response_tokens += self.response_lengths[row]
            self.prompt_tokens += self.prompt_lengths[row]
            self.prompt_width = max(self.prompt_width, self.prompt_lengths[row])
            self.response_width = max(self.response_width, self.response_lengths[row], 1)


def layout_tokens(layout: str, rows: Sequence[int], prompt_lengths: Sequence[int],
                  response_lengths: Sequence[int], group_size: int = 1) -> int:
    """Tokens of ``rows`` as fed to the model in ``layout`` (:class:`Tally`)."""
    return Tally(layout, prompt_lengths, response_lengths, group_size).with_rows(rows)


def _ordered(rows: Sequence[int], prompt_lengths: Sequence[int], response_lengths: Sequence[int], layout: str,
             group_size: int) -> list[list[int]]:
    """The rows in the order they are packed, as runs that stay together where they fit:
    single rows by response then prompt length (padding stays small); for the
    shared-prompt layout each group's rows (by response length), groups by prompt length."""
    if layout != "shared_prompt":
        return [[row] for row in sorted(rows, key=lambda row: (response_lengths[row], prompt_lengths[row], row))]
    groups: dict[int, list[int]] = {}
    for row in rows:
        groups.setdefault(row // group_size, []).append(row)
    return [sorted(members, key=lambda row: (response_lengths[row], row))
            for _, members in sorted(groups.items(), key=lambda item: (prompt_lengths[item[1][0]], item[0]))]


def pack_by_tokens(rows: Sequence[int], prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                   budget: int, *, layout: str = "padded", group_size: int = 1) -> tuple[list[list[int]], list[int]]:
    """(micro-batches, rows over the budget): ``rows`` packed greedily under ``budget``
    tokens as fed to the model in ``layout`` (:class:`Tally`). A group of the
    shared-prompt layout stays in one micro-batch where it fits one, else it is split over
    several, its prompt in each. A row longer than the budget on its own gets a
    micro-batch of its own and is listed second."""
    if budget < 1:
        raise ValueError(f"a token budget must be positive, got {budget}")

    def new_tally() -> Tally:
        return Tally(layout, prompt_lengths, response_lengths, group_size)

    micro_batches: list[list[int]] = []
    oversized: list[int] = []
    current: list[int] = []
    tally = new_tally()
    for run in _ordered(rows, prompt_lengths, response_lengths, layout, group_size):
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


def split_to_count(micro_batches: list[list[int]], count: int, prompt_lengths: Sequence[int],
                   response_lengths: Sequence[int], *, layout: str = "padded", group_size: int = 1) -> list[list[int]]:
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
                      key=lambda micro: layout_tokens(layout, micro, prompt_lengths, response_lengths, group_size))
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
