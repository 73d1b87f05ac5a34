"""The "torch" backend: runs anywhere PyTorch does, with autograd.

The surrogate is the reference itself (``reference/surrogate.py``); the log-probs from hidden
states come from the tiled online log-sum-exp (``tiled_logprobs.py``), so no [N, V]
tensor exists. It has no gradients-in-forward linear path: the linear loss runs the
log-probs and then the surrogate, and backward recomputes the logits tiles.
"""

from __future__ import annotations

import torch

from ..reference.surrogate import surrogate_loss
from .tiled_logprobs import tiled_token_logprobs


class TorchBackend:
    name = "torch"
    linear_surrogate = None
    scale_in_place = None
    compacts_rows = False

    def serves(self, device: torch.device) -> bool:
        return True

    def unavailable_message(self, device: torch.device) -> str:
        raise AssertionError("the torch backend serves every device")

    def has_gradients_in_forward(self, device: torch.device) -> bool:
        return False

    surrogate_loss = staticmethod(surrogate_loss)
    token_logprobs = staticmethod(tiled_token_logprobs)


BACKEND = TorchBackend()
