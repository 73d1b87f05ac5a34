"""The tables every backend reads, at the bottom of the package: each aggregation mode,
rollout-correction rule, advantage estimator and metric a row; an option's bounds; the
accumulation dtypes; the linear loss's constants (docs/architecture.md, "Modules")."""
