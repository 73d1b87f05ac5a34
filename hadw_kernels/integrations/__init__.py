"""HA-DW and the fused loss inside the trainers RL engineers use.

- :mod:`hadw_kernels.integrations.trl`: ``HADWGRPOTrainer`` and ``HADWGRPOConfig`` for
  TRL's ``GRPOTrainer`` (extra ``trl``; docs/integrations/trl.md).
- :mod:`hadw_kernels.integrations.verl`: the ``hadw`` advantage estimator, the ``hadw``
  and ``hadw_gspo`` policy losses and the anchor's checkpoint callback, registered in
  verl's registries (extra ``verl``; docs/integrations/verl.md).

- :mod:`hadw_kernels.integrations.verl_rollout_correction`: verl's rollout-correction
  options (threshold strings) as a ``RolloutCorrection``; it imports no verl.
- :mod:`hadw_kernels.integrations.verl_metrics`: verl's metrics of its policy losses, as
  the ``hadw_`` losses report them; it imports no verl.

Each of trl and verl imports its trainer, so this package imports neither.
"""
