"""``nn.Module`` forms of the losses, for trainers that build the loss once (as Liger's
``LigerFusedLinearGRPOLoss``): the options are held, the tensors passed per call."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .loss import call_options, check_options, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss


def _per_call(function) -> set[str]:
    """The parameters of ``function`` that take a tensor (the batch's, passed per call);
    every other keyword is an option the module holds."""
    return {name for name, parameter in inspect.signature(function).parameters.items()
            if "Tensor" in str(parameter.annotation)}


class _HeldOptions(torch.nn.Module):
    # The loss a subclass holds the options of (a staticmethod there).
    _function: ClassVar[Callable[..., Any] | None] = None

    def __init__(self, **options) -> None:
        super().__init__()
        accepted = call_options(type(self)._function) - _per_call(type(self)._function)
        unknown = set(options) - accepted
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown options {sorted(unknown)}; expected some of {sorted(accepted)}")
        # The call's own option checks, run now: a bad option fails where it is written.
        check_options(type(self)._function, **options)
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in self.options.items())


class HADWGRPOLoss(_HeldOptions):
    """``HADWGRPOLoss(loss_type="dapo", beta=0.04)(logprobs, old_logprobs, None, mask,
    advantages=adv)``: :func:`fused_hadw_grpo_loss` with held options (or a held
    ``config=LossConfig.build(...)``)."""

    _function = staticmethod(fused_hadw_grpo_loss)

    def forward(self, logprobs, old_logprobs, rewards, response_mask, **tensors):
        return fused_hadw_grpo_loss(logprobs, old_logprobs, rewards, response_mask, **tensors, **self.options)


class LinearHADWGRPOLoss(_HeldOptions):
    """:func:`fused_linear_hadw_grpo_loss` with held options; the call takes the hidden
    states, the LM head weight, the labels and the per-batch tensors."""

    _function = staticmethod(fused_linear_hadw_grpo_loss)

    def forward(self, hidden_states, lm_head_weight, labels, old_logprobs, rewards, response_mask, **tensors):
        return fused_linear_hadw_grpo_loss(
            hidden_states, lm_head_weight, labels, old_logprobs, rewards, response_mask, **tensors, **self.options
        )
