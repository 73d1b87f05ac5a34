"""The policy objectives: each one row of ``table.OBJECTIVES`` that holds its options,
its gradient route, its per-response step and its reference formulas (``formulas.py``,
docs/math.md, section 5)."""
