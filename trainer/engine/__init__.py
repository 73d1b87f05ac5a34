"""The training loop and its parts: the policy engine, rollouts, micro-batches, checkpoints, the
metrics log and its plots, the process environment."""
