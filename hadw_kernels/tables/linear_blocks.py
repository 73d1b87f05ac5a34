"""How the linear loss sweeps its rows: the paths it takes (:data:`LINEAR_PATHS`), the
label that counts no row (:data:`IGNORE_INDEX`), and how many rows a block holds, whose
logits fill one ``[block_rows, V]`` buffer (:func:`block_rows_for`, the one formula every
backend uses)."""

from __future__ import annotations

# How the linear loss forms its gradients (loss.fused_linear_hadw_grpo_loss).
LINEAR_PATHS = ("auto", "gradients_in_forward", "recompute")

IGNORE_INDEX = -100

# The linear loss holds the logits of ``block_rows`` rows at once, a [block_rows, V]
# buffer. By default the rows are split into even blocks of at most the device's
# buffer bytes and rows, a multiple of its row granule. CUDA (Triton): 1 GiB, where an
# H100's block GEMMs run at full speed (docs/benchmarks.md, "On a GPU"). CPU (the C++ kernels, which
# compile these values in through the generated header; Triton's interpreter uses them
# too): 640 MiB and at most 1024 rows, since grad_W's GEMM reduces over a block's rows
# and grad_W is read and written once per block, so fewer rows ran slower (measured in
# docs/architecture.md, "C++: the linear kernels").
LOGITS_BUFFER_BYTES = {"cuda": 1 << 30, "cpu": 640 << 20}
MAX_BLOCK_ROWS = {"cuda": 1 << 30, "cpu": 1024}
BLOCK_ROWS_GRANULE = {"cuda": 16, "cpu": 64}


def head_accumulator_bytes(vocab: int, hidden: int, element_size: int) -> int:
    """The fp32 accumulator of a 16-bit LM head's gradient over several blocks (rounded
    once at the end, as eager's single GEMM over every row is); none for fp32/fp64."""
    return 4 * vocab * hidden if element_size < 4 else 0


def block_rows_for(rows: int, vocab: int, element_size: int, device_type: str, requested: int | None = None,
                   accumulator_bytes: int = 0) -> int:
    """Rows per block of the linear loss: ``requested``, or the rows split into even
    blocks within the device's LOGITS_BUFFER_BYTES and MAX_BLOCK_ROWS (blocks of at most
    3533 rows for 8192 run as 3 x 2736, not 3533 + 3533 + 1126), a multiple of its
    BLOCK_ROWS_GRANULE. ``element_size`` is that of the buffer's dtype.

    ``accumulator_bytes`` (``head_accumulator_bytes``) is what several blocks would add:
    when all rows' logits fit in the budget plus that, they are one block, which holds no
    more memory and spares the accumulator's passes (on an H100 at the Qwen3-4B head,
    8192 bf16 rows: one block instead of three, docs/benchmarks.md, "On a GPU")."""
    if requested:
        return requested
    device = device_type if device_type in LOGITS_BUFFER_BYTES else "cpu"
    granule = BLOCK_ROWS_GRANULE[device]
    budget = LOGITS_BUFFER_BYTES[device]
    if rows <= MAX_BLOCK_ROWS[device] and rows * vocab * element_size <= budget + accumulator_bytes:
        blocks = 1
    else:
        by_budget = budget // max(vocab * element_size, 1)
        largest = max(granule, min(MAX_BLOCK_ROWS[device], by_budget) // granule * granule)
        blocks = max(1, -(-rows // largest))
    even = -(-rows // blocks)
    return max(granule, -(-even // granule) * granule)


def check_block_rows(block_rows, name: str = "block_rows") -> None:
    """None (the backend's default) or a positive int."""
    if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1):
        raise ValueError(f"{name} must be a positive int, got {block_rows!r}")


def check_linear_path(linear_path, name: str = "linear_path") -> None:
    if linear_path not in LINEAR_PATHS:
        raise ValueError(f"unknown {name} {linear_path!r}; expected one of {LINEAR_PATHS}")
