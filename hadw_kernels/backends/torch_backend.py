"""The "torch" backend: runs anywhere PyTorch does.

The surrogate is the reference itself. The log-probs are computed tile by tile over
tokens and vocabulary with an online log-sum-exp, so that no [N, V] tensor exists:
peak memory grows with N*H + V*H plus one tile, which gives a CPU user the memory win
of the fused kernels.

Backward recomputes each logits tile rather than forming the gradients during forward:
the log-probs feed an arbitrary surrogate (gspo needs every token's log-prob of a
sequence before any token's gradient is known), and the recompute costs one GEMM per
tile, the same as the extra pass a gradients-in-forward scheme needs for that case.
"""

from __future__ import annotations

import torch

from ..surrogate import surrogate_loss

__all__ = ["surrogate_loss", "token_logprobs"]

TOKEN_TILE = 1024
VOCAB_TILE = 4096


class _TiledLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, ignore_index, with_entropy):
        num_tokens = hidden.shape[0]
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).long()
        accumulate = torch.promote_types(hidden.dtype, torch.float32)
        hidden_acc = hidden.to(accumulate)
        running_max = torch.full((num_tokens,), float("-inf"), device=hidden.device, dtype=accumulate)
        sum_exp = torch.zeros_like(running_max)
        # Entropy needs E_p[z]; summing exp(z - m) * (z - m) relative to the running max
        # avoids subtracting two logit-sized numbers at the end.
        sum_exp_shifted = torch.zeros_like(running_max) if with_entropy else None
        label_logit = torch.zeros_like(running_max)
        for rows, columns, _, logits in _logit_tiles(hidden_acc, weight, bias, temperature):
            new_max = torch.maximum(running_max[rows], logits.amax(dim=1))
            rescale = torch.exp(running_max[rows] - new_max)
            shifted = torch.exp(logits - new_max[:, None])
            if with_entropy:
                max_moved = running_max[rows] - new_max
                carried = torch.where(sum_exp[rows] > 0, max_moved * sum_exp[rows], torch.zeros_like(new_max))
                sum_exp_shifted[rows] = rescale * (sum_exp_shifted[rows] + carried) + (
                    shifted * (logits - new_max[:, None])
                ).sum(dim=1)
            sum_exp[rows] = sum_exp[rows] * rescale + shifted.sum(dim=1)
            running_max[rows] = new_max
            in_tile, column = _label_columns(safe_labels[rows], columns)
            picked = logits.gather(1, column).squeeze(1)
            label_logit[rows] = torch.where(in_tile, picked, label_logit[rows])
        lse = running_max + torch.log(sum_exp)
        logp = torch.where(valid, label_logit - lse, torch.zeros_like(lse))
        mean_logit = None
        entropy = None
        if with_entropy:
            mean_shifted = sum_exp_shifted / sum_exp
            mean_logit = running_max + mean_shifted
            entropy = torch.where(valid, torch.log(sum_exp) - mean_shifted, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, safe_labels, valid, lse, mean_logit)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, valid, lse, mean_logit = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = weight.shape[0]
        accumulate = lse.dtype
        zeros = torch.zeros_like(lse)
        grad_logp = zeros if grad_logp is None else torch.where(valid, grad_logp.to(accumulate), zeros)
        if grad_entropy is not None and mean_logit is not None:
            grad_entropy = torch.where(valid, grad_entropy.to(accumulate), zeros)
        else:
            grad_entropy = None
        hidden_acc = hidden.to(accumulate)
        grad_hidden = torch.zeros_like(hidden_acc) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device, dtype=accumulate) if ctx.needs_input_grad[1] else None
        )
        grad_bias = (
            torch.zeros(vocab, device=weight.device, dtype=accumulate)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for rows, columns, weight_tile, logits in _logit_tiles(hidden_acc, weight, bias, temperature):
            probs = torch.exp(logits - lse[rows, None])
            # d logp / d z = onehot - p ; d entropy / d z = -p (z - E_p[z])
            grad_logits = probs * -grad_logp[rows, None]
            if grad_entropy is not None:
                grad_logits -= grad_entropy[rows, None] * probs * (logits - mean_logit[rows, None])
            in_tile, column = _label_columns(labels[rows], columns)
            onehot_grad = torch.where(in_tile, grad_logp[rows], torch.zeros_like(grad_logp[rows]))
            grad_logits.scatter_add_(1, column, onehot_grad[:, None])
            grad_logits /= temperature
            if grad_hidden is not None:
                grad_hidden[rows].addmm_(grad_logits, weight_tile)
            if grad_weight is not None:
                grad_weight[columns].addmm_(grad_logits.T, hidden_acc[rows])
            if grad_bias is not None:
                grad_bias[columns] += grad_logits.sum(dim=0)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def _logit_tiles(hidden, weight, bias, temperature):
    """Yields (token slice, vocabulary slice, head tile, logits tile) over the [N, V] grid,
    vocabulary outermost so each head tile is cast to the accumulation dtype once."""
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    for v0 in range(0, vocab, VOCAB_TILE):
        columns = slice(v0, min(v0 + VOCAB_TILE, vocab))
        weight_tile = weight[columns].to(hidden.dtype)
        bias_tile = None if bias is None else bias[columns].to(hidden.dtype)
        for n0 in range(0, num_tokens, TOKEN_TILE):
            rows = slice(n0, min(n0 + TOKEN_TILE, num_tokens))
            logits = hidden[rows] @ weight_tile.T
            if bias_tile is not None:
                logits += bias_tile
            if temperature != 1.0:
                logits /= temperature
            yield rows, columns, weight_tile, logits


def _label_columns(labels, columns):
    """Which labels fall in this vocabulary tile, and their column in it (clamped
    in range for the others, whose value is then discarded)."""
    in_tile = (labels >= columns.start) & (labels < columns.stop)
    column = (labels - columns.start).clamp(0, columns.stop - columns.start - 1)[:, None]
    return in_tile, column


def token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N] (fp32, or fp64 for fp64 inputs) (and entropy [N]) without materialising the logits."""
    return _TiledLinearLogprob.apply(
        hidden_states, lm_head_weight, lm_head_bias, labels, float(temperature), ignore_index, with_entropy
    )
