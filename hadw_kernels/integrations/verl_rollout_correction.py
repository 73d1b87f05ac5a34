"""verl's ``algorithm.rollout_correction`` options as a :class:`RolloutCorrection`: its
threshold strings ("upper", "lower_upper", comma-separated per filter) parsed strictly.
It imports no verl, so it serves without the verl extra; the parser is the integration's,
not ``correction_table``'s, so that the table imports no integration.
"""

from __future__ import annotations

import re

from ..tables.corrections import RejectionFilter, RolloutCorrection

# A number as verl's thresholds write one: digits, a point, an exponent; no Python
# digit-group underscores, which would read "0.5_2_0" (a malformed "lower_upper") as 20.
_VERL_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def rollout_correction_from_verl(rollout_is: str | None = None, rollout_is_threshold: str | float | None = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                       rollout_rs_threshold: str | float | None = None) -> RolloutCorrection:
    """``rollout_is`` "token" or "sequence" with a threshold "upper" (TIS) or
    "lower_upper" (IcePop), and the comma-separated ``rollout_rs`` filters with one
    threshold each (or one for all; a k1 threshold is "lower_upper" or "upper")."""
    lower, upper = (_verl_bounds(rollout_is_threshold, "rollout_is_threshold") if rollout_is is not None
                    else (None, None))
    filters = []
    if rollout_rs is not None:
        names = [name.strip() for name in rollout_rs.split(",") if name.strip()]
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold")
        specs = [part.strip() for part in str(rollout_rs_threshold).split(",") if part.strip()]
        specs = specs * len(names) if len(specs) == 1 else specs
        if len(specs) != len(names):
            raise ValueError(f"rollout_rs_threshold has {len(specs)} values for {len(names)} filters")
        for name, spec in zip(names, specs):
            filter_lower, filter_upper = _verl_bounds(spec, "rollout_rs_threshold")
            filters.append(RejectionFilter(name, upper=filter_upper, lower=filter_lower))
    return RolloutCorrection(level=rollout_is, rule="truncate" if lower is None else "mask", lower=lower, upper=upper,
                             batch_normalize=rollout_is_batch_normalize, rejection=tuple(filters))


def _verl_bounds(spec, option: str) -> tuple[float | None, float]:
    """verl's threshold "upper" or "lower_upper" (or a number: the upper bound)."""
    expected = "a number, or a string 'upper' or 'lower_upper' such as '2.0' or '0.5_2.0'"
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError(f"{option} must be {expected}, got {spec!r}")
    if not isinstance(spec, str):
        return None, float(spec)
    parts = spec.strip().split("_")
    if len(parts) > 2 or not all(_VERL_NUMBER.fullmatch(part) for part in parts):
        raise ValueError(f"{option} must be {expected}, got {spec!r}")
    bounds = [float(part) for part in parts]
    return (None, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
