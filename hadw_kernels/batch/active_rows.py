"""The rows of the linear loss that enter the LM head's GEMMs.

A row is active when its label is not ``ignore_index``: the losses set that label at
every position the loss does not count (padding, a packed row's prompt positions), so
an inactive row has no log-prob, no entropy and no gradient. Which rows are active is
known on the device only. Where the value checks run (``check_values=True``, the
default, and not under ``torch.compile``) their one host read carries the count too
(``validation.linear_batch``, ``value_checks.check_label_range``), and the rows are then found
without a second read (``torch.nonzero_static`` with that size); the Triton and torch
backends then sweep the active rows alone. Without the checks no count is read and
every row enters the GEMMs, an inactive one zeroed (docs/architecture.md,
"Which rows enter the GEMMs"). The C++ kernels find the active rows themselves on the
CPU (``Backend.compacts_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import torch


def active_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """[N] bool: the rows whose label counts. The count read with the value checks and
    the rows swept are both formed from this one tensor, so they agree."""
    return labels != ignore_index


@dataclass(frozen=True, slots=True)
class RowSelection:
    """The rows a linear sweep runs over: the active ones (``index`` [R], of ``total``
    rows), or every row (``index`` None: ``take`` and ``put`` return their input)."""

    index: torch.Tensor | None = None
    total: int = 0

    @classmethod
    def of(cls, active: torch.Tensor | None, count: int | None) -> "RowSelection":
        """The ``count`` rows that ``active`` (from :func:`active_rows`) marks, found
        without a host read; every row when nothing was counted or every row is active
        (no gather or scatter then)."""
        if active is None or count is None or count == active.shape[0]:
            return cls()
        return cls(torch.nonzero_static(active, size=count).flatten(), active.shape[0])

    @overload
    def take(self, values: torch.Tensor) -> torch.Tensor: ...
    @overload
    def take(self, values: None) -> None: ...
    @overload
    def take(self, values: torch.Tensor | None) -> torch.Tensor | None: ...

    def take(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """``values`` [N, ...] at the selected rows (differentiable)."""
        if self.index is None or values is None:
            return values
        return values.index_select(0, self.index)

    @overload
    def put(self, values: torch.Tensor) -> torch.Tensor: ...
    @overload
    def put(self, values: None) -> None: ...
    @overload
    def put(self, values: torch.Tensor | None) -> torch.Tensor | None: ...

    def put(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """``values`` of the selected rows back at their rows of [N, ...], zero at the
        others (differentiable)."""
        if self.index is None or values is None:
            return values
        zeros = values.new_zeros((self.total, *values.shape[1:]))
        return zeros.index_copy(0, self.index, values)
