"""docs/architecture.md, "One call, hop by hop", lists the hops of one call of each loss:
a trace of the call holds the tables to the code. Every call into ``hadw_kernels`` that a
listed hop with listed hops under it (or the public function) makes is a listed hop, in
the listed order and depth, or one of the helpers the section leaves out (``NOT_HOPS``)."""

import re
import sys
from pathlib import Path

import pytest
import torch

import hadw_kernels
from hadw_kernels import available_backends, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
PACKAGE = Path(hadw_kernels.__file__).resolve().parent

# The calls the section leaves out: helpers of one tensor, the checks' own helpers, the
# batch's copies with a field changed, and what runs after an op returns.
NOT_HOPS = {
    "loss._checks_run",
    "loss._has_correction",
    "batch.inputs.SurrogateBatch.replace",
    "batch.inputs.SurrogateBatch.current_logprobs",
    "batch.inputs.SurrogateBatch.behaviour_logprobs",
    "checks.arguments.device_of",
    "checks.arguments.require_tensor",
    "checks.arguments.require_float",
    "checks.arguments.require_layout_shape",
    "batch.token_layout.TokenLayout.flat",
    "batch.token_layout.TokenLayout.flat_rows",
    "batch.token_layout.TokenLayout.per_token",
    "batch.token_layout.TokenLayout.expand",
    "batch.inputs.caller_advantages",
    "batch.active_rows.RowSelection.take",
    "batch.active_rows.RowSelection.put",
    "ops.autograd.attach_gradients",
    "ops.autograd.attach_single_use_gradients",
}


def _documented(loss: str) -> list[tuple[int, str]]:
    """(depth, hop) of the section's table for ``loss``."""
    section = DOC.read_text().split("## One call, hop by hop", 1)[1].split("\n## ", 1)[0]
    table = section.split(f"`{loss}`:", 1)[1].split("\n\n", 2)[1]
    return [(int(depth), hop) for depth, hop in re.findall(r"^\| (\d) \| `([^`]+)` \|", table, re.MULTILINE)]


def _name(frame) -> str | None:
    """A frame's function as the section names it (its module under hadw_kernels/, then
    its qualified name; a dataclass's ``__init__`` by its class), or None outside the
    package and for a batch's copy with a field changed (``dataclasses.replace``)."""
    code = frame.f_code
    if code.co_name == "__init__" and "self" in frame.f_locals:
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.endswith("dataclasses.py"):
            return None
        kind = type(frame.f_locals["self"])
        return f"{kind.__module__.removeprefix('hadw_kernels.')}.{kind.__qualname__}" \
            if kind.__module__.startswith("hadw_kernels.") else None
    path = Path(code.co_filename)
    if PACKAGE not in path.parents:
        return None
    module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    return f"{module}.{code.co_qualname}"


def _traced(call, public: str, documented: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(depth, hop) of every call that the public function or a hop with listed hops
    under it makes into the package, but for ``NOT_HOPS``."""
    parents = {public} | {hop for (depth, hop), (next_depth, _) in zip(documented, documented[1:])
                          if next_depth > depth}
    stack, seen = [], []  # stack: (name, depth as a hop or None) of the frames in the package

    def profile(frame, event, arg):
        if event == "call":
            name = _name(frame)
            depth = None
            if stack and name is not None and name not in NOT_HOPS:
                caller, caller_depth = stack[-1]
                if caller == public:
                    depth = 1
                elif caller in parents and caller_depth is not None:
                    depth = caller_depth + 1
                if depth is not None:
                    seen.append((depth, name))
            if name == public and not stack:
                stack.append((name, 0))
            elif stack:
                stack.append((name or "", depth))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def _inputs(width=5):
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(4, width)
    mask[1, 3:] = 0
    old = -torch.rand(4, width, generator=generator, dtype=torch.float64)
    return dict(old_logprobs=old, rewards=torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64),
                response_mask=mask)


@pytest.mark.skipif("cpp" not in available_backends("cpu"), reason="the tables trace the CPU default, cpp")
def test_the_surrogate_call_takes_the_documented_hops():
    inputs = _inputs()
    logprobs = (inputs["old_logprobs"] + 0.1).requires_grad_()
    documented = _documented("fused_hadw_grpo_loss")
    traced = _traced(lambda: fused_hadw_grpo_loss(logprobs, **inputs, group_size=2), "loss.fused_hadw_grpo_loss",
                     documented)
    assert traced == documented


@pytest.mark.skipif("cpp" not in available_backends("cpu"), reason="the tables trace the CPU default, cpp")
def test_the_linear_call_takes_the_documented_hops():
    inputs = _inputs()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 16, (4, 5), generator=generator)
    documented = _documented("fused_linear_hadw_grpo_loss")
    traced = _traced(lambda: fused_linear_hadw_grpo_loss(hidden, weight, labels, **inputs, group_size=2),
                     "loss.fused_linear_hadw_grpo_loss", documented)
    assert traced == documented
