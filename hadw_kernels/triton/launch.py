"""A Triton kernel launched with little host work a call: its constant arguments bound
once, and on a GPU its compiled kernel called straight after the first launch.

Triton's own launch (``kernel[grid](...)``) binds every argument by name, forms the
specialisation key of all of them and looks up its cache on every call: for kernels of
~40 arguments a large share of a small call's host time on a GPU (docs/architecture.md,
"Host work of a launch"). A :class:`BoundKernel` holds what one option set fixes (the
constexprs, the options' scalars, ``num_warps``) and takes the rest, the tensors and
shapes of a call, by position. On a GPU it keys the kernels Triton compiled by what Triton
specialises those arguments on (each tensor's dtype and 16-byte alignment, each integer's
divisibility by 16 and whether it is 1: Triton's own ``native_specialize_impl``) and the
device, and a known key launches the compiled kernel on the current stream as Triton's
launch does. The first launch of a key, and every launch under the interpreter
(``TRITON_INTERPRET=1``, which compiles nothing), go through ``kernel[grid]``.
"""

from __future__ import annotations

import functools

import torch

from .token_math import INTERPRETING

__all__ = ["BoundKernel", "bound_kernel"]


@functools.lru_cache(maxsize=None)
def _direct_launches() -> bool:
    """Whether compiled kernels can be launched straight: Triton compiles here (no
    interpreter) and a GPU runs them."""
    return not INTERPRETING and torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _specialiser():
    """Triton's specialisation of one argument, ``(type, attribute)``, for the current
    target: what its launch keys its compiled kernels by."""
    from triton._C.libtriton import native_specialize_impl
    from triton.compiler import make_backend
    from triton.runtime import driver

    return functools.partial(native_specialize_impl, make_backend(driver.active.get_current_target()))


def _current_stream(device: int):
    from triton.runtime import driver

    return driver.active.get_current_stream(device)


class BoundKernel:
    """``kernel`` with the parameters in ``constants`` (and launch options such as
    ``num_warps``) fixed; a call passes the other parameters in the kernel's order:
    ``bound(grid, *arguments)``."""

    def __init__(self, kernel, **constants) -> None:
        self.kernel = kernel
        self.constants = constants
        names = list(kernel.arg_names)
        self.names = [name for name in names if name not in constants]
        # Every parameter's value in the kernel's order, a call's filled into its slots.
        self._template = [constants.get(name) for name in names]
        self._slots = [names.index(name) for name in self.names]
        self._compiled: dict[tuple, object] = {}

    def __call__(self, grid, *arguments) -> None:
        if len(arguments) != len(self.names):
            raise TypeError(f"{self.kernel.__name__}: expected arguments {self.names}, got {len(arguments)}")
        if _direct_launches():
            device = torch.cuda.current_device()
            key = self._key(device, arguments)
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._launch(compiled, device, grid, arguments)
                return
            compiled = self._through_triton(grid, arguments)
            if _launches_directly(compiled):
                self._compiled[key] = compiled
            return
        self._through_triton(grid, arguments)

    def _through_triton(self, grid, arguments):
        return self.kernel[grid](**dict(zip(self.names, arguments)), **self.constants)

    @staticmethod
    def _key(device: int, arguments) -> tuple:
        specialise = _specialiser()
        # Floats are not specialised (Triton types them and passes them on).
        return (device,) + tuple(
            None if isinstance(argument, float) else specialise(argument, False, True, True) for argument in arguments
        )

    def _launch(self, compiled, device: int, grid, arguments) -> None:
        from triton import knobs

        values = list(self._template)
        for slot, argument in zip(self._slots, arguments):
            values[slot] = argument
        stream = _current_stream(device)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
                     knobs.runtime.launch_exit_hook, *values)


def _launches_directly(compiled) -> bool:
    """Whether Triton's launch returned a loaded compiled kernel with the launcher this
    module calls (an asynchronous compile returns none yet)."""
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata", "launch_metadata")) and \
        compiled.function is not None


_BOUND: dict[tuple, BoundKernel] = {}


def bound_kernel(kernel, **constants) -> BoundKernel:
    """The :class:`BoundKernel` of ``kernel`` with these constants, made once per distinct
    set (an option set's), and kept: what depends only on the options is formed once."""
    key = (kernel, tuple(constants.items()))
    bound = _BOUND.get(key)
    if bound is None:
        bound = _BOUND[key] = BoundKernel(kernel, **constants)
    return bound
