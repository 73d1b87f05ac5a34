"""The suite's interpreter shortcut (tests/triton_interpreter.py) is in force and changes
no result: a kernel whose helpers see the kernel's language module (the shortcut skips
their patching) or only ``triton.language.core`` (patched as the interpreter does)
computes what PyTorch does, program after program, and leaves ``triton.language`` as
it found it."""

import importlib.util
import os
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton", reason="the triton extra is not installed")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")

CORE_HELPERS = textwrap.dedent('''
    import triton
    import triton.language.core as core


    @triton.jit
    def positive_part(x):
        return core.where(x > 0, x, 0.0)
''')


@triton.jit
def _doubled(x):
    return tl.maximum(x, x) * 2.0


# The module of core-only helpers, loaded from a file by the test (the interpreter reads
# a kernel's names from its module's globals, not from a closure).
core_helpers = None


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, core_helpers.positive_part(_doubled(x)), mask=mask)


def test_helpers_compute_the_same_and_the_language_is_restored(tmp_path, monkeypatch):
    if not hasattr(interpreter, "_LangPatchScope"):
        pytest.skip("this Triton's interpreter has other internals: the shortcut is not installed")
    assert getattr(interpreter._patch_lang, "_hadw_shortcut", False)
    module_path = tmp_path / "core_helpers.py"
    module_path.write_text(CORE_HELPERS)
    spec = importlib.util.spec_from_file_location("core_helpers", module_path)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    monkeypatch.setattr(sys.modules[__name__], "core_helpers", helpers)

    x = torch.randn(37)
    out = torch.empty_like(x)
    _kernel[(3,)](x, out, x.numel(), BLOCK=16)  # three programs, the last one masked
    torch.testing.assert_close(out, torch.clamp_min(2 * x, 0.0), rtol=0, atol=0)
    _kernel[(3,)](-x, out, x.numel(), BLOCK=16)  # a second launch after the first restored
    torch.testing.assert_close(out, torch.clamp_min(-2 * x, 0.0), rtol=0, atol=0)
    assert tl.core.is_builtin(tl.maximum) and tl.core.is_builtin(tl.where)
