import os
import tempfile

# The suite runs on the CPU by default, the Triton kernels in Triton's interpreter, which
# must be on before any @triton.jit function is defined. HADW_TEST_DEVICE=cuda runs the
# same tests on a GPU with the kernels compiled (scripts/gpu_check.sh).
TEST_DEVICE = os.environ.get("HADW_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interpreter import skip_repeated_language_patches

    skip_repeated_language_patches()

# Under ATEN_CPU_CAPABILITY (the suite run with another instruction set: avx2, default),
# Inductor's cache of compiled code and precompiled headers is kept apart: its keys do not
# hold the capability, and code cached under another one failed to compile (default) or
# crashed the process (avx2).
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"))

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (the README's -n 2) the workers share the machine's cores: one
# intra-op thread each, rather than each worker's default of every core. Tests that
# measure threading set their own counts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(items):
    """The tests marked slow run first, in their collected order, then the rest.

    The README's command splits the items between its two workers in order and lets an
    idle worker take over the other's last pending ones (``--dist worksteal``): with
    the slow tests first, the short ones are what is left to share at the end, and the
    workers finish together. In the files' order the trainer's tests came last, and one
    worker ran them while the other had nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
