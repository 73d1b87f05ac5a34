"""The backend fixture: every backend of the registry runs every test of this suite.

A backend that cannot serve the test device here is skipped with its reason, unless
HADW_REQUIRE_BACKENDS names it (CI: "cpp,triton"), which turns the skip into a failure.
Marks (declared in pyproject.toml): ``cpp``, ``triton``; select with ``-m``.
"""

import os

import pytest
import torch

from hadw_kernels.backends import BACKENDS, BackendUnavailable, load_backend

DEVICE = torch.device(os.environ.get("HADW_TEST_DEVICE", "cpu"))
REQUIRED = set(filter(None, os.environ.get("HADW_REQUIRE_BACKENDS", "").split(",")))


def _unavailable(name: str) -> str | None:
    try:
        backend = load_backend(name)
    except BackendUnavailable as error:
        return str(error)
    return None if backend.serves(DEVICE) else backend.unavailable_message(DEVICE)


def _param(name: str):
    marks = [getattr(pytest.mark, name)] if name != "torch" else []
    reason = _unavailable(name)
    if reason is not None and name not in REQUIRED:
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(params=[_param(name) for name in BACKENDS])
def backend(request):
    reason = _unavailable(request.param)
    if reason is not None:
        pytest.fail(f"HADW_REQUIRE_BACKENDS names {request.param!r}, but {reason}")
    return request.param


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _small_torch_tiles(monkeypatch):
    """The torch backend's tiles cross the suite's small shapes as the kernels' blocks do."""
    from hadw_kernels.backends import tiled_logprobs

    monkeypatch.setattr(tiled_logprobs, "TOKEN_TILE", 8)
    monkeypatch.setattr(tiled_logprobs, "VOCAB_TILE", 64)
