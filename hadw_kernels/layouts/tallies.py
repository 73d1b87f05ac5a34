"""What a set of a batch's rows would feed the model in each layout, counted without
building anything (docs/layouts.md, "What a layout builds"): a trainer cuts micro-batches
under a token budget with these. Each layout of ``builders.py`` names its tally."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from numbers import Integral

from .rows import RowTokens


class TokenTally:
    """The tokens a growing set of a batch's rows (``rows.RowTokens``) feeds in a layout,
    counted without building anything: ``with_rows`` what it would feed once ``rows``
    (indices of the batch's rows) join, ``add`` them."""

    def __init__(self, batch: RowTokens) -> None:
        if not isinstance(batch, RowTokens):
            raise TypeError(f"a tally counts a RowTokens (the rows' prompt and response token ids), not a "
                            f"{type(batch).__name__}")
        self.batch = batch
        self.rows: list[int] = []

    def with_rows(self, rows: Sequence[int]) -> int:
        """The tokens fed once ``rows`` join (without adding them)."""
        return self._with_rows(self._checked(rows))

    def add(self, rows: Sequence[int]) -> None:
        self._add(self._checked(rows))

    def _checked(self, rows: Sequence[int]) -> list[int]:
        rows, count = list(rows), len(self.batch)
        for row in rows:
            if type(row) is bool or not isinstance(row, Integral) or not 0 <= row < count:
                raise ValueError(f"row {row!r} is not one of the batch's {count} rows")
        return rows

    def _with_rows(self, rows: Sequence[int]) -> int:
        raise NotImplementedError

    def _add(self, rows: Sequence[int]) -> None:
        self.rows.extend(rows)


class PaddedTally(TokenTally):
    """Every row padded to the widest prompt and the widest response (at least one
    response position)."""

    def __init__(self, batch: RowTokens) -> None:
        super().__init__(batch)
        self.prompt_width = self.response_width = 0

    def _widths(self, rows: Sequence[int]) -> tuple[int, int]:
        return (max([self.prompt_width, *(self.batch.prompt_lengths[row] for row in rows)]),
                max([self.response_width, 1, *(self.batch.response_lengths[row] for row in rows)]))

    def _with_rows(self, rows: Sequence[int]) -> int:
        return (len(self.rows) + len(rows)) * sum(self._widths(rows))

    def _add(self, rows: Sequence[int]) -> None:
        super()._add(rows)
        self.prompt_width, self.response_width = self._widths(rows)


class PackedTally(TokenTally):
    """Every prompt and response token."""

    def __init__(self, batch: RowTokens) -> None:
        super().__init__(batch)
        self.tokens = 0

    def _tokens(self, rows: Sequence[int]) -> int:
        return sum(self.batch.prompt_lengths[row] + self.batch.response_lengths[row] for row in rows)

    def _with_rows(self, rows: Sequence[int]) -> int:
        return self.tokens + self._tokens(rows)

    def _add(self, rows: Sequence[int]) -> None:
        super()._add(rows)
        self.tokens += self._tokens(rows)


class SharedPromptTally(TokenTally):
    """Each group's prompt once but its last token (whole where the group's responses
    here are all empty), and every response token."""

    def __init__(self, batch: RowTokens) -> None:
        super().__init__(batch)
        self.response_tokens = 0
        self.prompts: dict[int, tuple[int, bool]] = {}  # group -> (prompt length, a response here has tokens)

    def _merged(self, rows: Sequence[int]) -> dict[int, tuple[int, bool]]:
        prompts = dict(self.prompts)
        lengths = self.batch.response_lengths
        for row in rows:
            group = self.batch.groups[row]
            has_tokens = prompts.get(group, (0, False))[1] or lengths[row] > 0
            prompts[group] = (self.batch.prompt_lengths[row], has_tokens)
        return prompts

    def _with_rows(self, rows: Sequence[int]) -> int:
        prompts = sum(length - has_tokens for length, has_tokens in self._merged(rows).values())
        return self.response_tokens + sum(self.batch.response_lengths[row] for row in rows) + prompts

    def _add(self, rows: Sequence[int]) -> None:
        super()._add(rows)
        self.prompts = self._merged(rows)
        self.response_tokens += sum(self.batch.response_lengths[row] for row in rows)


class PrefixTreeTally(TokenTally):
    """The distinct tokens of the rows' fed sequences (:func:`fed_sequence`): kept sorted,
    a sequence joining between two others adds its length less its longest common
    prefix with either (sorted, no earlier sequence shares more with it)."""

    def __init__(self, batch: RowTokens) -> None:
        super().__init__(batch)
        self.sorted: list[list[int]] = []
        self.tokens = 0

    def _joined(self, rows: Sequence[int], sequences: list[list[int]]) -> int:
        tokens = 0
        for row in rows:
            sequence = fed_sequence(self.batch.prompts[row], self.batch.responses[row])
            at = bisect.bisect_left(sequences, sequence)
            shared = max(common_prefix_length(sequences[at - 1], sequence) if at else 0,
                         common_prefix_length(sequence, sequences[at]) if at < len(sequences) else 0)
            tokens += len(sequence) - shared
            sequences.insert(at, sequence)
        return tokens

    def _with_rows(self, rows: Sequence[int]) -> int:
        return self.tokens + self._joined(rows, list(self.sorted))

    def _add(self, rows: Sequence[int]) -> None:
        super()._add(rows)
        self.tokens += self._joined(rows, self.sorted)


def fed_sequence(prompt: list[int], response: list[int]) -> list[int]:
    """The tokens of a row the prefix tree feeds: its prompt and its response but the last
    token, whose hidden state predicts nothing (the prompt alone for an empty response)."""
    return prompt + response[:-1]


def common_prefix_length(first: list[int], second: list[int]) -> int:
    """How many leading tokens ``first`` and ``second`` share; list slices compared in C,
    bisected (a sequence runs to thousands of tokens)."""
    low, high = 0, min(len(first), len(second))
    if first[:high] == second[:high]:
        return high
    while high - low > 1:  # first[:low] == second[:low], first[:high] != second[:high]
        middle = (low + high) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle
    return low
