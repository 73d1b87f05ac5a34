"""The Triton kernels of the ops (``hadw_kernels/ops/schemas.py``): ``surrogate`` for the
surrogate op, ``linear_logprob`` for the three linear ops, ``scale`` for the in-place
gradient scaling; ``token_math`` holds the per-token math the first two share. Imported
by the triton backend only."""
