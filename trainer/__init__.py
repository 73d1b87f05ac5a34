"""A minimal GRPO-family trainer with HA-DW: see docs/trainer.md. Run ``python -m trainer.run``
(or ``python trainer/run.py``).

Its floors, each importing only those below it: ``run`` (the command); ``tools`` (the
probe, the comparison, the calibration); ``engine`` (the loop and its parts); ``config``;
``tasks`` and ``models``; ``checkpoint_files`` (file utilities several floors share).
"""
