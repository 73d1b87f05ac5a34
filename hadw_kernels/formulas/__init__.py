"""The call-level formulas in plain PyTorch that the reference and the losses share: the
per-token terms, the aggregation and the rollout correction (docs/math.md)."""
