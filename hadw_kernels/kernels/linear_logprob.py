"""Triton kernels for ``hadw::linear_logprob_forward`` / ``_backward`` (SPEC section 6).

Forward: programs own a tile of tokens and a contiguous range of vocabulary tiles (a
"vocabulary split", so that a small batch still fills the GPU). Each computes its logits
tiles with an fp32 (fp64 for fp64 inputs) GEMM accumulator, adds the bias, divides by the
temperature and folds the tile into a running max, sum of exp and, for the entropy, sum
of exp times the logit relative to the running max. A second small kernel merges the
splits into logp, entropy, lse and mean_logit: O(splits * N) floats, never N x V.

Backward: one program per (token tile, vocabulary tile) recomputes its logits tile,
forms dz = g (onehot - p) - g_ent p (z - mean_logit), divided by the temperature, and
adds dz W into grad_hidden and dz^T h into grad_weight with fp32 atomics, one hidden
chunk at a time. docs/fused-linear-logprob.md gives the FLOP and byte counts behind the
choice of recompute and atomics, and the tile sizes.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["linear_logprob_backward", "linear_logprob_forward"]

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

_TRITON_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}

# Rows per program of the kernel that merges the vocabulary splits.
_MERGE_BLOCK = 128


@dataclass(frozen=True)
class _Tiles:
    block_tokens: int
    block_vocab: int
    block_hidden: int
    num_warps: int
    num_stages: int
    # Backward: token tiles that run next to each other on one vocabulary tile, so a
    # weight tile is read from DRAM once and served from L2 to the whole group.
    group_tokens: int


def _tiles(device: torch.device, element_size: int, backward: bool) -> _Tiles:
    if device.type != "cuda":
        # The interpreter runs one program at a time in numpy: small tiles keep the
        # tests fast and make their tiny shapes cross every tile edge.
        return _Tiles(16, 64, 16, num_warps=4, num_stages=1, group_tokens=2)
    # 128 x 128 logits tiles: the tensor-core GEMM tile that keeps A100/H100 compute
    # bound, and a 64 KB fp32 accumulator (64 registers a thread over 8 warps). A K-step
    # reads 128 bytes of each row in forward (64 in backward, whose dz tile and two
    # gradient chunks need the registers); fp64 (tests) halves the tiles to fit.
    major, _ = torch.cuda.get_device_capability(device)
    row_bytes = 64 if backward else 128
    tile = 64 if element_size == 8 else 128
    return _Tiles(
        tile,
        tile,
        row_bytes // element_size,
        num_warps=8,
        num_stages=4 if major >= 9 else 3,
        group_tokens=8,
    )


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        # Enough for the tests' few token tiles to take the multi-split path.
        return 4
    # Two waves of programs over the multiprocessors.
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _vocab_splits(num_token_tiles: int, num_vocab_tiles: int, device: torch.device) -> tuple[int, int]:
    """(splits, vocabulary tiles per split); every split gets at least one tile."""
    wanted = min(triton.cdiv(_target_programs(device), max(num_token_tiles, 1)), num_vocab_tiles)
    tiles_per_split = triton.cdiv(num_vocab_tiles, wanted)
    return triton.cdiv(num_vocab_tiles, tiles_per_split), tiles_per_split


def _dot_dtype(dtype: torch.dtype):
    # The interpreter's bf16 tl.dot is silently wrong; bf16 tiles upcast to fp32 give
    # the same exact products and fp32 sums. On a GPU bf16 stays on the tensor cores.
    if _INTERPRETING and dtype == torch.bfloat16:
        return tl.float32
    return _TRITON_DTYPES[dtype]


@triton.jit
def _logits_tile(
    hidden_ptr, weight_ptr, bias_ptr, temperature,
    rows, cols, row_in, col_in, hidden_size,
    stride_hidden_row, stride_hidden_col, stride_weight_row, stride_weight_col,
    HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """(h W^T + b) / temperature for one tile, accumulated in ACC_DTYPE; -inf past V."""
    logits = tl.zeros([BLOCK_N, BLOCK_V], dtype=ACC_DTYPE)
    for h0 in range(0, hidden_size, BLOCK_H):
        ks = h0 + tl.arange(0, BLOCK_H)
        k_in = ks < hidden_size
        hidden = tl.load(
            hidden_ptr + rows[:, None] * stride_hidden_row + ks[None, :] * stride_hidden_col,
            mask=row_in[:, None] & k_in[None, :], other=0.0,
        )
        weight_t = tl.load(
            weight_ptr + cols[None, :] * stride_weight_row + ks[:, None] * stride_weight_col,
            mask=col_in[None, :] & k_in[:, None], other=0.0,
        )
        # "ieee": fp32 inputs get full fp32 products (as eager PyTorch), never TF32.
        logits = tl.dot(hidden.to(DOT_DTYPE), weight_t.to(DOT_DTYPE), logits, input_precision="ieee")
    if HAS_BIAS:
        logits += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(ACC_DTYPE)[None, :]
    logits = logits / temperature
    return tl.where(col_in[None, :], logits, float("-inf"))


@triton.jit
def _forward_split_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, temperature_ptr,
    split_max_ptr, split_sum_exp_ptr, split_sum_exp_shifted_ptr, split_label_logit_ptr,
    num_tokens, vocab, hidden_size, tiles_per_split,
    stride_hidden_row, stride_hidden_col, stride_weight_row, stride_weight_col,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One token tile x one vocabulary split: online log-sum-exp statistics [N] per split.

    With u = z - running_max the split keeps sum exp(u), sum exp(u) * u and the label's
    logit. Keeping u (not z) in the entropy sum avoids cancelling two large numbers in
    entropy = lse - E[z] when the logits are large.
    """
    token_tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = (token_tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_in = rows < num_tokens
    labels = tl.load(labels_ptr + rows, mask=row_in, other=-1)
    temperature = tl.load(temperature_ptr)

    running_max = tl.full([BLOCK_N], float("-inf"), dtype=ACC_DTYPE)
    sum_exp = tl.zeros([BLOCK_N], dtype=ACC_DTYPE)
    sum_exp_shifted = tl.zeros([BLOCK_N], dtype=ACC_DTYPE)
    label_logit = tl.zeros([BLOCK_N], dtype=ACC_DTYPE)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, tl.cdiv(vocab, BLOCK_V))
    for vocab_tile in range(first_tile, end_tile):
        cols = (vocab_tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_in = cols < vocab
        logits = _logits_tile(
            hidden_ptr, weight_ptr, bias_ptr, temperature, rows, cols, row_in, col_in, hidden_size,
            stride_hidden_row, stride_hidden_col, stride_weight_row, stride_weight_col,
            HAS_BIAS, ACC_DTYPE, DOT_DTYPE, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        rescale = tl.exp(running_max - new_max)
        shifted = logits - new_max[:, None]
        exp_shifted = tl.exp(shifted)
        if WITH_ENTROPY:
            # Moving the reference point from the old max to the new one adds
            # (old - new) to every earlier u; before the first tile the sums are 0
            # and (old - new) is -inf, hence the where.
            moved = tl.where(sum_exp > 0, running_max - new_max, 0.0) * sum_exp
            tile_sum = tl.sum(exp_shifted * tl.where(col_in[None, :], shifted, 0.0), axis=1)
            sum_exp_shifted = rescale * (sum_exp_shifted + moved) + tile_sum
        sum_exp = sum_exp * rescale + tl.sum(exp_shifted, axis=1)
        running_max = new_max
        label_logit += tl.sum(tl.where(cols[None, :] == labels[:, None], logits, 0.0), axis=1)

    offsets = split * num_tokens + rows
    tl.store(split_max_ptr + offsets, running_max, mask=row_in)
    tl.store(split_sum_exp_ptr + offsets, sum_exp, mask=row_in)
    tl.store(split_label_logit_ptr + offsets, label_logit, mask=row_in)
    if WITH_ENTROPY:
        tl.store(split_sum_exp_shifted_ptr + offsets, sum_exp_shifted, mask=row_in)


@triton.jit
def _merge_splits_kernel(
    split_max_ptr, split_sum_exp_ptr, split_sum_exp_shifted_ptr, split_label_logit_ptr, labels_ptr,
    logprobs_ptr, entropy_ptr, lse_ptr, mean_logit_ptr,
    num_tokens, num_splits, ignore_index,
    WITH_ENTROPY: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Folds the splits' statistics together (the same online update) into the outputs."""
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    row_in = rows < num_tokens
    running_max = tl.full([BLOCK], float("-inf"), dtype=ACC_DTYPE)
    sum_exp = tl.zeros([BLOCK], dtype=ACC_DTYPE)
    sum_exp_shifted = tl.zeros([BLOCK], dtype=ACC_DTYPE)
    label_logit = tl.zeros([BLOCK], dtype=ACC_DTYPE)
    for split in range(0, num_splits):
        offsets = split * num_tokens + rows
        split_max = tl.load(split_max_ptr + offsets, mask=row_in, other=0.0)
        split_sum_exp = tl.load(split_sum_exp_ptr + offsets, mask=row_in, other=1.0)
        new_max = tl.maximum(running_max, split_max)
        rescale = tl.exp(running_max - new_max)
        split_rescale = tl.exp(split_max - new_max)
        if WITH_ENTROPY:
            split_sum_exp_shifted = tl.load(split_sum_exp_shifted_ptr + offsets, mask=row_in, other=0.0)
            moved = tl.where(sum_exp > 0, running_max - new_max, 0.0) * sum_exp
            sum_exp_shifted = rescale * (sum_exp_shifted + moved) + split_rescale * (
                split_sum_exp_shifted + (split_max - new_max) * split_sum_exp
            )
        sum_exp = sum_exp * rescale + split_sum_exp * split_rescale
        running_max = new_max
        label_logit += tl.load(split_label_logit_ptr + offsets, mask=row_in, other=0.0)

    labels = tl.load(labels_ptr + rows, mask=row_in, other=ignore_index)
    valid = labels != ignore_index
    log_sum_exp = tl.log(sum_exp)
    lse = running_max + log_sum_exp
    tl.store(lse_ptr + rows, lse, mask=row_in)
    tl.store(logprobs_ptr + rows, tl.where(valid, label_logit - lse, 0.0), mask=row_in)
    if WITH_ENTROPY:
        mean_shifted = sum_exp_shifted / sum_exp  # E_p[z] - running_max
        tl.store(mean_logit_ptr + rows, running_max + mean_shifted, mask=row_in)
        tl.store(entropy_ptr + rows, tl.where(valid, log_sum_exp - mean_shifted, 0.0), mask=row_in)


@triton.jit
def _backward_kernel(
    grad_logprobs_ptr, grad_entropy_ptr, hidden_ptr, weight_ptr, bias_ptr, labels_ptr,
    lse_ptr, mean_logit_ptr, temperature_ptr,
    grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
    num_tokens, vocab, hidden_size, ignore_index,
    stride_hidden_row, stride_hidden_col, stride_weight_row, stride_weight_col,
    stride_grad_hidden_row, stride_grad_hidden_col, stride_grad_weight_row, stride_grad_weight_col,
    stride_grad_bias,
    HAS_BIAS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_N: tl.constexpr,
):
    """One (token tile, vocabulary tile): recompute z, form dz, add its share of the grads."""
    num_token_tiles = tl.cdiv(num_tokens, BLOCK_N)
    num_vocab_tiles = tl.cdiv(vocab, BLOCK_V)
    pid = tl.program_id(0)
    programs_per_group = GROUP_N * num_vocab_tiles
    first_token_tile = (pid // programs_per_group) * GROUP_N
    group_height = tl.minimum(num_token_tiles - first_token_tile, GROUP_N)
    token_tile = first_token_tile + (pid % programs_per_group) % group_height
    vocab_tile = (pid % programs_per_group) // group_height

    rows = (token_tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_in = rows < num_tokens
    labels = tl.load(labels_ptr + rows, mask=row_in, other=ignore_index)
    valid = row_in & (labels != ignore_index)
    grad_logprobs = tl.load(grad_logprobs_ptr + rows, mask=valid, other=0.0).to(ACC_DTYPE)
    active = grad_logprobs != 0
    if HAS_GRAD_ENTROPY:
        grad_entropy = tl.load(grad_entropy_ptr + rows, mask=valid, other=0.0).to(ACC_DTYPE)
        active = active | (grad_entropy != 0)
    # Ignored labels, padding and prompt tokens have zero upstream gradients: a tile of
    # only those adds exactly nothing, so it skips the recompute.
    if tl.max(active.to(tl.int32), axis=0) > 0:
        cols = (vocab_tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_in = cols < vocab
        temperature = tl.load(temperature_ptr)
        logits = _logits_tile(
            hidden_ptr, weight_ptr, bias_ptr, temperature, rows, cols, row_in, col_in, hidden_size,
            stride_hidden_row, stride_hidden_col, stride_weight_row, stride_weight_col,
            HAS_BIAS, ACC_DTYPE, DOT_DTYPE, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        lse = tl.load(lse_ptr + rows, mask=row_in, other=0.0)
        probs = tl.exp(logits - lse[:, None])
        # d logp / dz = onehot - p ; d entropy / dz = -p (z - E_p[z])
        grad_logits = tl.where(cols[None, :] == labels[:, None], grad_logprobs[:, None], 0.0)
        grad_logits -= grad_logprobs[:, None] * probs
        if HAS_GRAD_ENTROPY:
            mean_logit = tl.load(mean_logit_ptr + rows, mask=valid, other=0.0)
            # Columns past V hold -inf logits: centre them at 0, not -inf, so p * 0 = 0.
            centered = tl.where(col_in[None, :], logits - mean_logit[:, None], 0.0)
            grad_logits -= grad_entropy[:, None] * probs * centered
        grad_logits = tl.where(valid[:, None] & col_in[None, :], grad_logits / temperature, 0.0)

        if HAS_BIAS:
            tl.atomic_add(grad_bias_ptr + cols * stride_grad_bias, tl.sum(grad_logits, axis=0), mask=col_in,
                          sem="relaxed")
        # On a GPU dz enters the gradient GEMMs in the inputs' dtype (bf16 tensor cores,
        # fp32 accumulation), the rounding a bf16 model's own backward applies to it.
        grad_logits_op = grad_logits.to(DOT_DTYPE)
        for h0 in range(0, hidden_size, BLOCK_H):
            ks = h0 + tl.arange(0, BLOCK_H)
            k_in = ks < hidden_size
            weight = tl.load(
                weight_ptr + cols[:, None] * stride_weight_row + ks[None, :] * stride_weight_col,
                mask=col_in[:, None] & k_in[None, :], other=0.0,
            )
            grad_hidden = tl.dot(grad_logits_op, weight.to(DOT_DTYPE), input_precision="ieee",
                                 out_dtype=ACC_DTYPE)
            tl.atomic_add(
                grad_hidden_ptr + rows[:, None] * stride_grad_hidden_row + ks[None, :] * stride_grad_hidden_col,
                grad_hidden, mask=valid[:, None] & k_in[None, :], sem="relaxed",
            )
            hidden = tl.load(
                hidden_ptr + rows[:, None] * stride_hidden_row + ks[None, :] * stride_hidden_col,
                mask=row_in[:, None] & k_in[None, :], other=0.0,
            )
            grad_weight = tl.dot(tl.trans(grad_logits_op), hidden.to(DOT_DTYPE), input_precision="ieee",
                                 out_dtype=ACC_DTYPE)
            tl.atomic_add(
                grad_weight_ptr + cols[:, None] * stride_grad_weight_row + ks[None, :] * stride_grad_weight_col,
                grad_weight, mask=col_in[:, None] & k_in[None, :], sem="relaxed",
            )


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _temperature_tensor(temperature: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # A Python float reaches a kernel as fp32; fp64 inputs need the fp64 temperature.
    return torch.full((), float(temperature), dtype=dtype, device=device)


def linear_logprob_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, entropy, lse, mean_logit), each [N] in fp32 (fp64 for fp64 inputs).

    Without ``with_entropy`` entropy and mean_logit are zeros. Rows whose label is
    ``ignore_index`` get logprob 0 and entropy 0.
    """
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    accumulate = _accumulate_dtype(hidden.dtype)
    tiles = _tiles(device, hidden.element_size(), backward=False)
    labels = labels.contiguous()
    num_token_tiles = triton.cdiv(num_tokens, tiles.block_tokens)
    num_splits, tiles_per_split = _vocab_splits(num_token_tiles, triton.cdiv(vocab, tiles.block_vocab), device)

    split_max, split_sum_exp, split_sum_exp_shifted, split_label_logit = torch.empty(
        (4, num_splits, num_tokens), dtype=accumulate, device=device
    ).unbind()
    logprobs = torch.empty(num_tokens, dtype=accumulate, device=device)
    lse = torch.empty_like(logprobs)
    entropy = torch.zeros_like(logprobs)
    mean_logit = torch.zeros_like(logprobs)
    acc_dtype = _TRITON_DTYPES[accumulate]

    _forward_split_kernel[(num_token_tiles, num_splits)](
        hidden, weight, weight if bias is None else bias, labels,
        _temperature_tensor(temperature, accumulate, device),
        split_max, split_sum_exp, split_sum_exp_shifted, split_label_logit,
        num_tokens, vocab, hidden_size, tiles_per_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy,
        ACC_DTYPE=acc_dtype, DOT_DTYPE=_dot_dtype(hidden.dtype),
        BLOCK_N=tiles.block_tokens, BLOCK_V=tiles.block_vocab, BLOCK_H=tiles.block_hidden,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    _merge_splits_kernel[(triton.cdiv(num_tokens, _MERGE_BLOCK),)](
        split_max, split_sum_exp, split_sum_exp_shifted, split_label_logit, labels,
        logprobs, entropy, lse, mean_logit,
        num_tokens, num_splits, ignore_index,
        WITH_ENTROPY=with_entropy, ACC_DTYPE=acc_dtype, BLOCK=_MERGE_BLOCK,
    )
    return logprobs, entropy, lse, mean_logit


def linear_logprob_backward(
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    lse: torch.Tensor,
    mean_logit: torch.Tensor,
    temperature: float,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes; grad_bias is empty
    (shape (0,)) without a bias. ``lse`` and ``mean_logit`` come from the forward."""
    num_tokens, hidden_size = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} in backward, hidden {tuple(hidden.shape)}: a ZeRO-3 "
            "LM head gathered for the forward must stay gathered through the backward "
            "(docs/fused-linear-logprob.md)"
        )
    vocab = weight.shape[0]
    device = hidden.device
    accumulate = _accumulate_dtype(hidden.dtype)
    tiles = _tiles(device, hidden.element_size(), backward=True)

    # Accumulators shaped like the inputs (same strides), so the cast back returns
    # tensors laid out as the op's fake implementation promises.
    grad_hidden = torch.zeros_like(hidden, dtype=accumulate)
    grad_weight = torch.zeros_like(weight, dtype=accumulate)
    grad_bias = weight.new_empty((0,)) if bias is None else torch.zeros_like(bias, dtype=accumulate)
    grad_logprobs = grad_logprobs.contiguous()
    num_programs = triton.cdiv(num_tokens, tiles.block_tokens) * triton.cdiv(vocab, tiles.block_vocab)

    _backward_kernel[(num_programs,)](
        grad_logprobs, grad_logprobs if grad_entropy is None else grad_entropy.contiguous(),
        hidden, weight, weight if bias is None else bias, labels.contiguous(),
        lse.contiguous(), mean_logit.contiguous(), _temperature_tensor(temperature, accumulate, device),
        grad_hidden, grad_weight, grad_weight if bias is None else grad_bias,
        num_tokens, vocab, hidden_size, ignore_index,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        grad_hidden.stride(0), grad_hidden.stride(1), grad_weight.stride(0), grad_weight.stride(1),
        grad_bias.stride(0),
        HAS_BIAS=bias is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
        ACC_DTYPE=_TRITON_DTYPES[accumulate], DOT_DTYPE=_dot_dtype(hidden.dtype),
        BLOCK_N=tiles.block_tokens, BLOCK_V=tiles.block_vocab, BLOCK_H=tiles.block_hidden,
        GROUP_N=tiles.group_tokens, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return (
        grad_hidden.to(hidden.dtype),
        grad_weight.to(weight.dtype),
        grad_bias if bias is None else grad_bias.to(bias.dtype),
    )
