"""The hadw:: ops: schemas and fakes (``schemas``), one routed kernel per device key
(``routing``), and the autograd formulas (``autograd``)."""

from . import autograd  # noqa: F401  (registers the formulas)
from .autograd import attach_gradients
from .routing import BackendUnavailable, has_kernel, register_kernel, serves, set_unavailable_reason, unavailable_message
from .schemas import KERNEL_LIBRARY, LIBRARY, OPS, accumulate_dtype, argument_names, call

__all__ = [
    "KERNEL_LIBRARY",
    "LIBRARY",
    "OPS",
    "BackendUnavailable",
    "accumulate_dtype",
    "argument_names",
    "attach_gradients",
    "call",
    "has_kernel",
    "register_kernel",
    "serves",
    "set_unavailable_reason",
    "unavailable_message",
]
