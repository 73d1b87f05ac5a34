"""The Triton implementations of the linear ops: log-probs (and entropy) of labels under
softmax((h W^T + b) / temperature), and their gradients, one block of rows at a time.

The blocks are planned over the N rows the op is given (``linear_blocks.block_rows_for``): which
of them count (a label other than ``ignore_index``) is known on the device only, and
reading their count back would make the host wait for the GPU, so the ops never do. (The
losses give them only the active rows where their value checks' read counted those:
``active_rows.py``.) A block of rows is handled as

    z  = h_rows W^T (+ b)              one cuBLAS GEMM into a [rows, V] buffer
    _row_stats_kernel                  lse, logp, entropy, E_p[z] of each row
      or _row_surrogate_kernel         the same, and the token-level surrogate's
         (linear_surrogate_forward)    d loss / d logp, d loss / d entropy of each row
    _logit_gradient_kernel             dz = g (onehot - p) - g_ent p (z - E_p[z]),
                                       divided by the temperature, in place
    grad_h_rows = dz W ; grad_W += dz^T h_rows    two cuBLAS GEMMs

so the gradients-in-forward path (``linear_surrogate_forward``) costs the three GEMMs
that any exact method needs and two row launches a block, and the recompute path
(``linear_logprob_forward`` then ``_backward``, for losses whose gradient is known only
after every log-prob, GSPO) four GEMMs and one row launch a block each way. A row whose
label is ignored (padding) enters its block's GEMMs, its hidden state zeroed where a
gradient GEMM reads it (it may hold inf or NaN); the row kernels read none of its logits
and give it zeros and no gradient. The GEMMs are cuBLAS's, in the inputs' dtype with fp32
accumulation, exactly as eager PyTorch forms the logits and their gradients; the row
kernels compute in fp32 (fp64 for fp64 inputs). Memory: the [rows, V] buffer
(``block_rows``, docs/architecture.md, "The linear loss") plus, for 16-bit heads over several blocks,
an fp32 accumulator for grad_W.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..objectives.table import OBJECTIVE_NAMES, OBJECTIVES
from ..tables.linear_blocks import block_rows_for, head_accumulator_bytes
from ..tables.precision import accumulate_dtype
from .launch import bound_kernel
from .surrogate import device_guard, objective_arguments
from .token_math import INTERPRETING, kl_term, objective_option_values, policy_term, round_to_bfloat16, token_ratio

__all__ = [
    "linear_logprob_backward",
    "linear_logprob_forward",
    "linear_surrogate_forward",
]

# Columns a row program streams per step, all in fp32 at once.
_BLOCK_V = 4096


@triton.jit
def _row_stats(logits_ptr, stride_logits, labels_ptr, first_row, temperature, vocab, ignore_index,
               logprobs_ptr, entropy_ptr, lse_ptr, mean_logit_ptr, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row of the block: its logp, lse, entropy and E_p[z], stored at the row (both row
    kernels keep all four), and (its row, whether its label counts, logp) returned. By an
    online log-sum-exp over the vocabulary, a tile of columns at a time. The running max
    is the row's (one reduction per tile), so each logit costs one exp; the sums stay
    per lane. With u = z - running max each lane keeps sum exp(u) and, for the entropy,
    sum exp(u) u; keeping u (not z) avoids cancelling two large numbers in
    entropy = lse - E_p[z]. A NaN logit makes the sums, hence every output, NaN; a label
    outside the vocabulary gives a NaN log-prob. A row whose label is ``ignore_index``
    (padding) reads no logit, whatever its hidden state made of them, and gives zeros."""
    block_row = tl.program_id(0).to(tl.int64)
    row = first_row + block_row
    row_logits = logits_ptr + block_row * stride_logits
    label = tl.load(labels_ptr + row).to(tl.int64)
    active = label != ignore_index
    compute = temperature.dtype
    row_max = tl.full([], float("-inf"), compute)
    lane_sum = tl.zeros([BLOCK_V], compute)
    lane_shifted = tl.zeros([BLOCK_V], compute)
    for start in range(0, tl.where(active, vocab, 0), BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_logits + cols, mask=cols < vocab, other=float("-inf")).to(compute) / temperature
        new_max = tl.maximum(row_max, tl.max(z, axis=0))
        # Until a finite logit is seen the sums stay zero (and no -inf - -inf is formed).
        unseen = new_max == float("-inf")
        rescale = tl.where(unseen, 0.0, tl.exp(row_max - new_max))
        shifted = tl.where(z == float("-inf"), 0.0, z - new_max)  # every z is -inf while unseen
        exp_shifted = tl.where(unseen, 0.0, tl.exp(z - new_max))
        if WITH_ENTROPY:
            moved = tl.where(row_max == float("-inf"), 0.0, row_max - new_max)  # lane sums are 0 then
            lane_shifted = rescale * (lane_shifted + moved * lane_sum) + exp_shifted * shifted
        lane_sum = lane_sum * rescale + exp_shifted
        row_max = new_max
    total = tl.sum(lane_sum, axis=0)
    log_total = tl.log(total)
    lse = tl.where(active, row_max + log_total, 0.0)
    in_vocab = (label >= 0) & (label < vocab)
    label_logit = tl.load(row_logits + tl.where(in_vocab & active, label, 0)).to(compute) / temperature
    logprob = tl.where(active, tl.where(in_vocab, label_logit - lse, float("nan")), 0.0)
    entropy = tl.zeros([], compute)
    mean_logit = tl.zeros([], compute)
    if WITH_ENTROPY:
        mean_shifted = tl.sum(lane_shifted, axis=0) / total  # E_p[z] - row max
        mean_logit = tl.where(active, row_max + mean_shifted, 0.0)
        entropy = tl.where(active, log_total - mean_shifted, 0.0)
    tl.store(lse_ptr + row, lse)
    tl.store(logprobs_ptr + row, logprob)
    tl.store(entropy_ptr + row, entropy)
    tl.store(mean_logit_ptr + row, mean_logit)
    return row, active, logprob


@triton.jit
def _row_stats_kernel(
    logits_ptr, stride_logits, labels_ptr, first_row, temperature: tl.float64,
    logprobs_ptr, entropy_ptr, lse_ptr, mean_logit_ptr,
    vocab, ignore_index,
    WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Rows first_row + program of the block: their log-probs, lse, entropy and E_p[z]."""
    temperature = tl.full([], temperature, lse_ptr.dtype.element_ty)
    _row_stats(logits_ptr, stride_logits, labels_ptr, first_row, temperature, vocab, ignore_index,
               logprobs_ptr, entropy_ptr, lse_ptr, mean_logit_ptr, WITH_ENTROPY, BLOCK_V)


@triton.jit
def _row_surrogate_kernel(
    logits_ptr, stride_logits, labels_ptr, first_row, temperature: tl.float64,
    logprobs_ptr, entropy_ptr, lse_ptr, mean_logit_ptr,
    old_ptr, ref_ptr, importance_ptr, advantage_ptr, agg_weight_ptr, grad_logprobs_ptr, grad_entropy_ptr,
    vocab, ignore_index,
    epsilon_low: tl.float64, epsilon_high: tl.float64,
    option_0: tl.float64, option_1: tl.float64, option_2: tl.float64, option_3: tl.float64,
    beta: tl.float64, entropy_coef: tl.float64,
    OBJECTIVE: tl.constexpr, ON_POLICY: tl.constexpr, HAS_KL: tl.constexpr, KL_ESTIMATOR: tl.constexpr,
    HAS_IMPORTANCE: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """``_row_stats_kernel``, and then the row's token-level surrogate gradient from its
    log-prob: d loss / d logp = w (iw * d policy_term + beta * d kl_term) and
    d loss / d entropy = -entropy_coef * w, with the per-token formulas of the surrogate
    kernel (0 on rows whose label is ignored), for the logits' gradient of the block."""
    temperature = tl.full([], temperature, lse_ptr.dtype.element_ty)
    row, active, logprob = _row_stats(logits_ptr, stride_logits, labels_ptr, first_row, temperature, vocab,
                                      ignore_index, logprobs_ptr, entropy_ptr, lse_ptr, mean_logit_ptr,
                                      WITH_ENTROPY, BLOCK_V)
    # The row's token as a block of one: the per-token helpers take blocks.
    index = row + tl.arange(0, 1)
    compute = temperature.dtype
    logprobs = tl.zeros([1], compute) + logprob
    if ON_POLICY:
        old = logprobs
    else:
        old = tl.load(old_ptr + index).to(compute)
    advantage = tl.load(advantage_ptr + index).to(compute)
    agg_weight = tl.where(active, tl.load(agg_weight_ptr + index).to(compute), 0.0)
    ratio, ratio_passes = token_ratio(logprobs - old)
    # (No objective that selects tokens takes this path: the loss forms their log-probs first.)
    _, grad = policy_term(
        ratio, ratio_passes, advantage, logprobs, old, tl.zeros([1], compute),
        tl.full([], 1.0 - epsilon_low, compute), tl.full([], 1.0 + epsilon_high, compute),
        tl.full([], epsilon_low, compute), tl.full([], epsilon_high, compute),
        objective_option_values(option_0, option_1, option_2, option_3, compute), OBJECTIVE,
    )
    if HAS_IMPORTANCE:
        grad *= tl.load(importance_ptr + index).to(compute)
    if HAS_KL:
        _, kl_slope = kl_term(logprobs, tl.load(ref_ptr + index).to(compute), KL_ESTIMATOR)
        grad += tl.full([], beta, compute) * kl_slope
    tl.store(grad_logprobs_ptr + index, tl.where(active, grad * agg_weight, 0.0))
    tl.store(grad_entropy_ptr + index, -tl.full([], entropy_coef, compute) * agg_weight)


@triton.jit
def _logit_gradient_kernel(
    logits_ptr, stride_logits, labels_ptr, first_row, temperature: tl.float64,
    grad_logprobs_ptr, stride_grad_logprobs, grad_entropy_ptr, stride_grad_entropy, lse_ptr, mean_logit_ptr,
    vocab, ignore_index,
    HAS_GRAD_ENTROPY: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """In place: z -> dz = (g (onehot - p) - g_ent p (z - E_p[z])) / temperature, in the
    buffer's dtype (the rounding eager applies to a bf16 model's logits gradient); exactly
    0 on a row whose label is ignored, whatever its logits hold."""
    block_row = tl.program_id(0).to(tl.int64)
    row = first_row + block_row
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < vocab
    label = tl.load(labels_ptr + row).to(tl.int64)
    # A block, not a scalar: the interpreter breaks a scalar boolean broadcast in a block's op.
    active = tl.zeros([BLOCK_V], tl.int64) + label != ignore_index
    compute = lse_ptr.dtype.element_ty
    temperature = tl.full([], temperature, compute)
    lse = tl.load(lse_ptr + row)
    grad_logprobs = tl.load(grad_logprobs_ptr + row * stride_grad_logprobs).to(compute)
    pointer = logits_ptr + block_row * stride_logits + cols
    z = tl.load(pointer, mask=inside, other=0.0).to(compute) / temperature
    probs = tl.exp(z - lse)
    grad = tl.where(cols == label, grad_logprobs, 0.0) - grad_logprobs * probs
    if HAS_GRAD_ENTROPY:
        grad_entropy = tl.load(grad_entropy_ptr + row * stride_grad_entropy).to(compute)
        # p (z - E_p[z]) is 0 at a -inf logit (p = 0), not 0 * -inf (docs/math.md, section 8, "Entropy").
        centred = tl.where(z == float("-inf"), 0.0, z - tl.load(mean_logit_ptr + row))
        grad -= grad_entropy * probs * centred
    grad = tl.where(active, grad / temperature, 0.0)
    if ROUND_BF16_BY_HAND:
        grad = round_to_bfloat16(grad)
    tl.store(pointer, grad.to(pointer.dtype.element_ty), mask=inside)


class _BlockSweep:
    """The blocks of rows and the GEMMs around the row kernels.

    The blocks are planned over all N rows given, a count the host knows: the rows whose
    label counts are never counted here (a read of the device, which would wait for it),
    so a row given whose label is ignored enters the GEMMs of its block, zeroed where a
    gradient GEMM would read it, and the row kernels give it zeros and no gradient
    (docs/architecture.md, "Which rows enter the GEMMs")."""

    def __init__(self, hidden, weight, bias, labels, ignore_index, block_rows):
        self.hidden, self.weight, self.bias, self.labels = hidden, weight, bias, labels.contiguous()
        self.ignore_index = ignore_index
        self.device = hidden.device
        self.vocab = weight.shape[0]
        self.rows = hidden.shape[0]
        self.accumulate = accumulate_dtype(hidden.dtype)
        self.block_rows = block_rows_for(
            self.rows, self.vocab, hidden.element_size(), self.device.type, block_rows,
            accumulator_bytes=head_accumulator_bytes(self.vocab, hidden.shape[1], hidden.element_size()),
        )
        self.buffer = torch.empty((min(self.block_rows, max(self.rows, 1)), self.vocab), dtype=hidden.dtype,
                                  device=self.device)
        self._ignored = None

    def blocks(self):
        """Each block's slice of the rows."""
        for start in range(0, self.rows, self.block_rows):
            yield slice(start, min(start + self.block_rows, self.rows))

    def logits(self, span, hidden_rows=None):
        """The block's z = h W^T + b, in the inputs' dtype, in the shared buffer."""
        logits = self.buffer[: span.stop - span.start]
        hidden_rows = self.hidden[span] if hidden_rows is None else hidden_rows
        if self.bias is None:
            torch.mm(hidden_rows, self.weight.t(), out=logits)
        else:
            torch.addmm(self.bias, hidden_rows, self.weight.t(), out=logits)
        return logits

    def counted_hidden(self, span):
        """The block's hidden states with the rows whose label is ignored zeroed: a gradient
        GEMM multiplies them by a zero gradient, and padding may hold inf or NaN."""
        if self._ignored is None:
            self._ignored = (self.labels == self.ignore_index)[:, None]
        return self.hidden[span].masked_fill(self._ignored[span], 0)

    def logit_gradient(self, logits, span, temperature, grad_logprobs, grad_entropy, lse, mean_logit):
        kernel = bound_kernel(
            _logit_gradient_kernel, HAS_GRAD_ENTROPY=grad_entropy is not None,
            ROUND_BF16_BY_HAND=INTERPRETING and logits.dtype == torch.bfloat16, BLOCK_V=_BLOCK_V, num_warps=8,
        )
        kernel(
            (span.stop - span.start, triton.cdiv(self.vocab, _BLOCK_V)),
            logits, logits.stride(0), self.labels, span.start, temperature,
            grad_logprobs, grad_logprobs.stride(0),
            grad_logprobs if grad_entropy is None else grad_entropy,
            0 if grad_entropy is None else grad_entropy.stride(0),
            lse, mean_logit, self.vocab, self.ignore_index,
        )


_FUSED_WIDENING_ADDMM = True


def _widening_addmm_(accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor, first: bool) -> None:
    """accumulator (+)= left @ right for 16-bit operands and an fp32 accumulator, "=" for
    the ``first`` block (the accumulator is then uninitialised and never read): one cuBLAS
    GEMM that reads and writes the accumulator in fp32 on CUDA."""
    global _FUSED_WIDENING_ADDMM
    beta = 0.0 if first else 1.0
    if left.is_cuda and _FUSED_WIDENING_ADDMM:
        try:
            torch.addmm(accumulator, left, right, beta=beta, out_dtype=accumulator.dtype, out=accumulator)
            return
        except (RuntimeError, TypeError):  # a torch without addmm(out_dtype=) in place
            _FUSED_WIDENING_ADDMM = False
    if left.is_cuda and first:
        accumulator.copy_(torch.mm(left, right, out_dtype=accumulator.dtype))
    elif left.is_cuda:
        accumulator += torch.mm(left, right, out_dtype=accumulator.dtype)
    else:
        # Every bf16/fp16 value is an fp32 value: widened operands give the same products.
        accumulator.addmm_(left.to(accumulator.dtype), right.to(accumulator.dtype), beta=beta)


class _Gradients:
    """grad_hidden, grad_weight and grad_bias, accumulated block by block."""

    def __init__(self, sweep: _BlockSweep):
        self.sweep = sweep
        hidden, weight, bias = sweep.hidden, sweep.weight, sweep.bias
        # Every block writes its rows (a padding row's gradient is 0: its logits' is).
        self.grad_hidden = torch.empty_like(hidden)
        # 16-bit heads over several blocks accumulate grad_W in fp32 (head_accumulator_bytes).
        several = sweep.rows > sweep.block_rows
        self.weight_dtype = sweep.accumulate if several else weight.dtype
        # The first block writes grad_W (no zero fill); later ones add to it.
        self.grad_weight = torch.empty_like(weight, dtype=self.weight_dtype)
        self.first = True
        self.grad_bias = None if bias is None else torch.zeros_like(bias, dtype=sweep.accumulate)

    def add(self, logit_grad, span, hidden_rows):
        weight = self.sweep.weight
        torch.mm(logit_grad, weight, out=self.grad_hidden[span])
        if self.weight_dtype != logit_grad.dtype:
            _widening_addmm_(self.grad_weight, logit_grad.t(), hidden_rows, first=self.first)
        elif self.first:
            torch.mm(logit_grad.t(), hidden_rows, out=self.grad_weight)
        else:
            self.grad_weight.addmm_(logit_grad.t(), hidden_rows)
        self.first = False
        if self.grad_bias is not None:
            self.grad_bias += logit_grad.sum(dim=0, dtype=self.sweep.accumulate)

    def result(self):
        weight, bias = self.sweep.weight, self.sweep.bias
        if self.first:  # no row: no block wrote grad_W
            self.grad_weight.zero_()
        grad_bias = weight.new_empty((0,)) if bias is None else self.grad_bias.to(bias.dtype)
        return self.grad_hidden, self.grad_weight.to(weight.dtype), grad_bias


def _row_outputs(num_rows: int, dtype: torch.dtype, device: torch.device):
    # logprobs, entropy, lse, mean_logit: the row kernels write every row (0 on ignored ones).
    return tuple(torch.empty(num_rows, dtype=dtype, device=device) for _ in range(4))


def linear_logprob_forward(hidden, weight, bias, labels, temperature, ignore_index, with_entropy):
    """``hadw::linear_logprob_forward``: (logprobs, entropy, lse, mean_logit), each [N]
    in fp32 (fp64 for fp64 inputs); ignored rows give 0."""
    sweep = _BlockSweep(hidden, weight, bias, labels, ignore_index, 0)
    outputs = _row_outputs(sweep.rows, sweep.accumulate, sweep.device)
    kernel = bound_kernel(_row_stats_kernel, WITH_ENTROPY=with_entropy, BLOCK_V=_BLOCK_V, num_warps=8)
    with device_guard(sweep.device):
        for span in sweep.blocks():
            logits = sweep.logits(span)
            kernel((span.stop - span.start,), logits, logits.stride(0), sweep.labels, span.start, float(temperature),
                   *outputs, sweep.vocab, ignore_index)
    return outputs


def linear_logprob_backward(grad_logprobs, grad_entropy, hidden, weight, bias, labels, lse, mean_logit, temperature,
                            ignore_index):
    """``hadw::linear_logprob_backward``: (grad_hidden, grad_weight, grad_bias) in the
    inputs' dtypes, recomputing each block's logits; grad_bias is (0,) without a bias."""
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} in backward, hidden {tuple(hidden.shape)}: a ZeRO-3 "
            "LM head gathered for the forward must stay gathered through the backward "
            "(docs/architecture.md, 'Calling the linear loss')"
        )
    sweep = _BlockSweep(hidden, weight, bias, labels, ignore_index, 0)
    gradients = _Gradients(sweep)
    grad_logprobs = grad_logprobs.to(sweep.accumulate)
    grad_entropy = None if grad_entropy is None else grad_entropy.to(sweep.accumulate)
    with device_guard(sweep.device):
        for span in sweep.blocks():
            hidden_rows = sweep.counted_hidden(span)
            logits = sweep.logits(span, hidden_rows)
            sweep.logit_gradient(logits, span, float(temperature), grad_logprobs, grad_entropy, lse, mean_logit)
            gradients.add(logits, span, hidden_rows)
    return gradients.result()


def linear_surrogate_forward(
    hidden, weight, bias, labels, old_logprobs, advantages, agg_weights, ref_logprobs, importance_weights,
    temperature, ignore_index, objective, epsilon_low, epsilon_high, objective_options, beta, kl_estimator,
    entropy_coef, with_entropy, block_rows,
):
    """``hadw::linear_surrogate_forward``: per-row (logprobs, entropy) and the token-level
    surrogate's (grad_hidden, grad_weight, grad_bias), each block's logits formed once.
    Per-token inputs are [N]; ``old_logprobs`` None means on-policy (old = current). The
    objective is taken in its token ratio form, which GMPO and VESPO (whole responses) do
    not have: they are refused."""
    name = OBJECTIVE_NAMES[objective]
    if "token" not in OBJECTIVES[name].ratio_levels:
        raise ValueError(f"objective {name!r} reads whole responses: the gradients-in-forward linear path has no "
                         "token form of it (linear_path='recompute')")
    sweep = _BlockSweep(hidden, weight, bias, labels, ignore_index, block_rows)
    gradients = _Gradients(sweep)
    logprobs, entropy, lse, mean_logit = outputs = _row_outputs(sweep.rows, sweep.accumulate, sweep.device)
    grad_logprobs = torch.empty(sweep.rows, dtype=sweep.accumulate, device=sweep.device)
    grad_entropy = torch.empty_like(grad_logprobs)
    has_kl = beta > 0
    kernel = bound_kernel(
        _row_surrogate_kernel, **objective_arguments(objective, epsilon_low, epsilon_high, objective_options),
        beta=float(beta), entropy_coef=float(entropy_coef), ON_POLICY=old_logprobs is None, HAS_KL=has_kl,
        KL_ESTIMATOR=kl_estimator, HAS_IMPORTANCE=importance_weights is not None,
        WITH_ENTROPY=with_entropy or entropy_coef > 0, BLOCK_V=_BLOCK_V, num_warps=8,
    )
    with device_guard(sweep.device):
        for span in sweep.blocks():
            hidden_rows = sweep.counted_hidden(span)
            logits = sweep.logits(span, hidden_rows)
            kernel(
                (span.stop - span.start,), logits, logits.stride(0), sweep.labels, span.start, float(temperature),
                *outputs, old_logprobs, ref_logprobs if has_kl else None, importance_weights, advantages, agg_weights,
                grad_logprobs, grad_entropy, sweep.vocab, ignore_index,
            )
            sweep.logit_gradient(logits, span, float(temperature), grad_logprobs,
                                 grad_entropy if entropy_coef > 0 else None, lse, mean_logit)
            gradients.add(logits, span, hidden_rows)
    return (logprobs, entropy, *gradients.result())
