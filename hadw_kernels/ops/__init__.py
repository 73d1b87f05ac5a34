"""The hadw:: ops: schemas and fakes (``schemas``), one routed kernel per device key
(``routing``), and how their gradients reach autograd (``autograd``)."""

from . import autograd  # noqa: F401  (registers linear_logprob_forward's formula)
from .autograd import attach_gradients, attach_single_use_gradients
from .routing import (
    BackendUnavailable,
    call,
    has_kernel,
    register_kernel,
    serves,
    set_unavailable_reason,
    unavailable_message,
)
from .schemas import KERNEL_LIBRARY, LIBRARY, OPS, argument_names

__all__ = [
    "KERNEL_LIBRARY",
    "LIBRARY",
    "OPS",
    "BackendUnavailable",
    "argument_names",
    "attach_gradients",
    "attach_single_use_gradients",
    "call",
    "has_kernel",
    "register_kernel",
    "serves",
    "set_unavailable_reason",
    "unavailable_message",
]
