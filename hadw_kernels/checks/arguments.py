"""The check primitives of a call's arguments: a tensor argument's type, dtype, shape in
the batch's layout and device, the anchor, the generator and the temperature. An option's
range is ``tables/bounds.py``'s; what a call as a whole must satisfy ``validation.py``'s;
the checks of values read in one host synchronisation ``values.py``'s.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, overload

import torch

from ..tables.bounds import check_finite_positive, compiling

if TYPE_CHECKING:
    from ..batch.token_layout import TokenLayout


@overload
def detached(tensor: torch.Tensor) -> torch.Tensor: ...
@overload
def detached(tensor: None) -> None: ...
@overload
def detached(tensor: torch.Tensor | None) -> torch.Tensor | None: ...

def detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` without its autograd history, detached only where it has one: a detach
    is an operator, and a small call's host time is counted in operators
    (docs/benchmarks.md, "Host time of a small call")."""
    return tensor.detach() if tensor is not None and tensor.requires_grad else tensor


def shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def device_of(name: str, value) -> torch.device:
    """The device of the tensor argument ``name`` (refused by name if not a tensor)."""
    return require_tensor(name, value).device


def require_float(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def require_per_token(name: str, tensor, layout: TokenLayout) -> None:
    """A floating-point per-token tensor of the batch's layout."""
    require_tensor(name, tensor)
    require_float(name, tensor)
    require_layout_shape(name, tensor, layout)


def require_layout_shape(name: str, tensor: torch.Tensor, layout: TokenLayout) -> None:
    """A padded batch's per-token tensors are [B, T], the response mask's shape; a packed
    batch's are [N] or [1, N], whatever form the mask came in."""
    if not layout.is_packed:
        if shape(tensor) != layout.shape:
            raise ValueError(f"{name} has shape {shape(tensor)}, response_mask {layout.shape}: they must match")
    elif shape(tensor) not in ((layout.tokens,), (1, layout.tokens)):
        raise ValueError(
            f"{name} has shape {shape(tensor)}, but this call is packed (cu_seqlens given): per-token tensors are "
            f"[N] = [{layout.tokens}] or [1, N]; a padded [B, T] batch takes no cu_seqlens"
        )


def require_per_segment(name: str, tensor: torch.Tensor, layout: TokenLayout) -> None:
    if shape(tensor) != (layout.segments,):
        what = "segment (len(cu_seqlens) - 1)" if layout.is_packed else "response"
        unit = "S" if layout.is_packed else "B"
        raise ValueError(f"{name} must be [{unit}] = [{layout.segments}], one per {what}, got shape {shape(tensor)}")


def require_values_device(name: str, device: torch.device) -> None:
    """Tensors on the meta device have shapes and no values, which every call here computes
    and checks: refused by name before a value is read."""
    if device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds shapes but no values: hadw-kernels computes values (and "
            "checks them), so it takes tensors on a real device (cpu, cuda); torch.compile traces its calls with "
            "fake tensors of that device"
        )


def check_anchor(anchor) -> None:
    """A belief C in [0, 1]: a float or a 0-d tensor (its value is checked with the others)."""
    if anchor is None:
        return
    if isinstance(anchor, bool) or not isinstance(anchor, (int, float, torch.Tensor)):
        raise TypeError(f"anchor must be a float in [0, 1], a 0-d tensor or None, got {anchor!r}")
    if isinstance(anchor, torch.Tensor):
        if anchor.dim() != 0:
            raise ValueError(f"anchor must be a float or a 0-d tensor, got shape {shape(anchor)}")
        if not anchor.is_floating_point():
            raise TypeError(f"anchor must be a floating-point tensor, got {anchor.dtype}")
    # Compiled, a float argument is symbolic: its range is a value check, skipped as the
    # others are (docs/architecture.md, "torch.compile").
    elif not compiling() and not (math.isfinite(anchor) and 0 <= anchor <= 1):
        raise ValueError(f"anchor must lie in [0, 1] (a belief about an accuracy), got {anchor}")


def check_generator(generator, device: torch.device) -> None:
    """The draw's generator (an objective's selection; clip_cov alone draws): None (torch's
    global one, as verl's), or a ``torch.Generator`` on the CPU (where the draw runs by
    default) or on the inputs' ``device``. Checked whatever the objective, so a wrong
    value is refused on the call that passes it, not on the first that draws."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (or None: torch's global one), got "
                        f"{type(generator).__module__}.{type(generator).__qualname__}")
    if generator.device.type != "cpu" and generator.device != device:
        raise ValueError(f"generator is on {generator.device}, the inputs on {device}: pass a generator on the "
                         "CPU or on the inputs' device")


def check_temperature(temperature) -> None:
    check_finite_positive("temperature", temperature)
