"""A minimal GRPO-family trainer with HA-DW: see docs/trainer.md. Run ``python trainer/run.py``
(from any directory) or ``python -m trainer.run`` (from the checkout's root).

Its floors, each importing only those below it: ``run`` (the command); ``tools`` (the
probe, the comparison, the calibration); ``config`` (the parts' sections composed);
``engine`` (the loop and its parts); ``tasks`` and ``models``; ``checkpoint_files`` and
``section`` (file utilities, and how a config section is declared).
"""
