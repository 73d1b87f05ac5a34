import os

# The suite runs on the CPU by default, the Triton kernels in Triton's interpreter, which
# must be on before any @triton.jit function is defined. HADW_TEST_DEVICE=cuda runs the
# same tests on a GPU with the kernels compiled (scripts/gpu_check.sh).
TEST_DEVICE = os.environ.get("HADW_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
