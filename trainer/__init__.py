"""A minimal GRPO-family trainer with HA-DW: see docs/trainer.md. Run ``python trainer/run.py``."""
