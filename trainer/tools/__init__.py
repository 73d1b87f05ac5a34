"""Commands beside the run: the memory probe, the GRPO / HA-DW comparison, the task calibration."""
