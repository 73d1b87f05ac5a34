"""An option's range and its check, which every table's rows declare: ``Bounds`` and
the common ones, ``check_finite_positive``, and ``compiling``: under torch.compile a float
may be symbolic, so value checks do not run while tracing (docs/architecture.md,
"torch.compile")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def compiling() -> bool:
    return torch.compiler.is_compiling()


def check_finite_positive(name: str, value) -> None:
    """``value`` is a finite positive real (lambda_scale, std_eps, ...): strings, bools,
    NaN and non-positive values raise ValueError naming ``name``. Under torch.compile a
    float argument is symbolic and its value is not checked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    if not compiling() and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")


@dataclass(frozen=True)
class Bounds:
    """The values an option takes, ``low < value < high`` (``<=`` on a closed side), and
    what its error says a value must do (``says``: "be finite and greater than 1"), after
    the option's name and, where given, what the value is (``gloss``: "clip range")."""

    low: float
    high: float
    says: str
    low_closed: bool = False
    high_closed: bool = False
    gloss: str = ""

    def hold(self, value: float) -> bool:
        above = self.low < value or (self.low_closed and value == self.low)
        below = value < self.high or (self.high_closed and value == self.high)
        return above and below  # (NaN holds neither)

    def check(self, name: str, value: float) -> None:
        """Refuses a ``value`` outside the bounds, naming the option ``name``."""
        if not self.hold(value):
            named = f"{name} ({self.gloss})" if self.gloss else name
            raise ValueError(f"{named} must {self.says}, got {value!r}")


POSITIVE = Bounds(0.0, math.inf, "be a finite positive number")
NON_NEGATIVE = Bounds(0.0, math.inf, "be finite and non-negative", low_closed=True)
FINITE = Bounds(-math.inf, math.inf, "be a finite number")
