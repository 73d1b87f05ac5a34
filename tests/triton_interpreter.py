"""The suite's one adjustment to Triton's interpreter: a device function called inside a
running kernel does not patch triton.language again.

The interpreter swaps triton.language's builtins for NumPy-backed versions while a kernel
runs (``_patch_lang``, undone when the kernel returns), and again on every call of a
``@triton.jit`` helper, walking every member of four modules each time although the
kernel's patches are still in force: the builtins are already swapped, so the walk finds
nothing to change. The kernels call their per-token helpers (hadw_kernels/triton/
token_math.py) once per block, and that walk was most of an interpreted test's time
(docs/architecture.md, "Running the suite"). Here a helper whose language modules the
running kernel already patched skips it; a helper that sees another module
(``triton.language.core`` where the kernel sees only ``triton.language``) is patched as
before. What runs is unchanged (tests/test_triton_interpreter.py).

An interpreter without these internals is left as it is.
"""

from __future__ import annotations

import inspect


def skip_repeated_language_patches() -> bool:
    """Installs the shortcut; False (and nothing changed) if this Triton lacks the
    internals it relies on."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "_hadw_shortcut", False):
        return False
    # The language modules the running kernel patched; None between kernels (a kernel
    # launch never happens inside another).
    patched: set[int] | None = None

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values()
                if inspect.ismodule(value) and value in (tl, tl.core)}

    class KernelScope(scope_type):
        """The kernel's patches; their restore ends the kernel's record."""

        def __init__(self, scope):
            super().__init__()
            self._changes = scope._changes

        def restore(self) -> None:
            nonlocal patched
            patched = None
            super().restore()

    def patch_lang(fn):
        nonlocal patched
        needed = languages(fn)
        if patched is not None and needed <= patched:
            return scope_type()  # a helper inside the kernel: its patches are in force
        scope = original(fn)
        if patched is not None:  # a helper seeing another module: patched, and kept as before
            patched |= needed
            return scope
        patched = needed
        return KernelScope(scope)

    patch_lang._hadw_shortcut = True
    interpreter._patch_lang = patch_lang
    return True
