"""Tasks and their rewards: the synthetic and arithmetic tasks, math datasets, the reward functions."""
