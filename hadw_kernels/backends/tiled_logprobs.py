"""Log-probs of labels from hidden states and the LM head, tile by tile in PyTorch.

Tokens and vocabulary are cut into tiles and the log-sum-exp is formed online, so no
[N, V] tensor exists: peak memory grows with N*H + V*H plus one tile, which gives a CPU
user without the C++ kernels the memory win of the fused ones (the "torch" backend).

Every row given enters the tiles, a row whose label is ``ignore_index`` (padding) zeroed
and masked out of the outputs and gradients: whatever it holds (inf, NaN) reaches no
output and no gradient. Nothing here reads how many rows count (on a GPU the read would
wait for it, and a compiled graph cannot loop over a count it does not know:
docs/architecture.md, "Host synchronisation"); the losses give only the active rows where
their value checks' read counted them (``active_rows.py``), else every row, whose
inactive ones then cost their share of the GEMMs. A label outside the vocabulary gives a
NaN log-prob rather than a wrong number.

Backward recomputes each logits tile rather than forming the gradients during forward:
the log-probs feed an arbitrary function, whose gradient is known only once every
log-prob is.
"""

from __future__ import annotations

import torch

from ..tables.precision import accumulate_dtype

TOKEN_TILE = 1024
VOCAB_TILE = 4096


class _TiledLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, ignore_index, with_entropy):
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        accumulate = accumulate_dtype(hidden.dtype)
        row_labels, hidden_rows, padding = _counted_rows(hidden, labels, ignore_index, accumulate)
        in_vocab = (row_labels >= 0) & (row_labels < vocab)
        running_max = torch.full((num_tokens,), float("-inf"), device=hidden.device, dtype=accumulate)
        sum_exp = torch.zeros_like(running_max)
        # Entropy needs E_p[z]; summing exp(z - m) * (z - m) relative to the running max
        # avoids subtracting two logit-sized numbers at the end.
        sum_exp_shifted = torch.zeros_like(running_max) if with_entropy else None
        label_logit = torch.zeros_like(running_max)
        for tile_rows, columns, _, logits in _logit_tiles(hidden_rows, weight, bias, temperature):
            new_max = torch.maximum(running_max[tile_rows], logits.amax(dim=1))
            # While every logit so far is -inf (a masked vocabulary's tile) the sums stay 0:
            # shifting by 0 then forms no -inf - -inf.
            shift = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
            rescale = torch.exp(running_max[tile_rows] - shift)
            shifted = torch.exp(logits - shift[:, None])
            if with_entropy:
                max_moved = running_max[tile_rows] - new_max
                previous = sum_exp[tile_rows]
                carried = torch.where(previous > 0, max_moved * previous, torch.zeros_like(new_max))
                # A -inf logit adds exp(-inf) (-inf) = 0 to the sum, not NaN
                # (docs/math.md, section 8, "Entropy").
                offsets = torch.where(logits == float("-inf"), torch.zeros_like(logits), logits - shift[:, None])
                sum_exp_shifted[tile_rows] = rescale * (sum_exp_shifted[tile_rows] + carried) + (
                    shifted * offsets
                ).sum(dim=1)
            sum_exp[tile_rows] = sum_exp[tile_rows] * rescale + shifted.sum(dim=1)
            running_max[tile_rows] = new_max
            in_tile, column = _label_columns(row_labels[tile_rows], columns)
            picked = logits.gather(1, column).squeeze(1)
            label_logit[tile_rows] = torch.where(in_tile, picked, label_logit[tile_rows])
        lse = running_max + torch.log(sum_exp)
        # Out of place: an output made by an in-place op got no gradient under torch.compile
        # (torch 2.11: every hidden-state and head gradient came back zero).
        logp = torch.where(in_vocab, label_logit - lse, torch.full_like(lse, float("nan"))).masked_fill(padding, 0)
        entropy = mean_logit = None
        if with_entropy:
            mean_shifted = sum_exp_shifted / sum_exp
            mean_logit = running_max + mean_shifted
            entropy = (torch.log(sum_exp) - mean_shifted).masked_fill(padding, 0)
        ctx.save_for_backward(hidden, weight, bias, row_labels, lse, mean_logit, padding)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, row_labels, lse, mean_logit, padding = ctx.saved_tensors
        accumulate = lse.dtype
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(accumulate).masked_fill(padding, 0)
        grad_entropy = None if grad_entropy is None or mean_logit is None else \
            grad_entropy.to(accumulate).masked_fill(padding, 0)
        hidden_rows = hidden.to(accumulate).masked_fill(padding[:, None], 0)
        grad_hidden_rows = torch.zeros_like(hidden_rows) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device, dtype=accumulate) if ctx.needs_input_grad[1] else None
        )
        grad_bias = (
            torch.zeros(weight.shape[0], device=weight.device, dtype=accumulate)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for tile_rows, columns, weight_tile, logits in _logit_tiles(hidden_rows, weight, bias, ctx.temperature):
            probs = torch.exp(logits - lse[tile_rows, None])
            # d logp / d z = onehot - p ; d entropy / d z = -p (z - E_p[z])
            grad_logits = probs * -grad_logp[tile_rows, None]
            if grad_entropy is not None:
                # p (z - E_p[z]) is 0 at a -inf logit (p = 0), not NaN.
                centred = logits - mean_logit[tile_rows, None]
                centred = torch.where(logits == float("-inf"), torch.zeros_like(centred), centred)
                grad_logits -= grad_entropy[tile_rows, None] * probs * centred
            in_tile, column = _label_columns(row_labels[tile_rows], columns)
            onehot_grad = torch.where(in_tile, grad_logp[tile_rows], torch.zeros_like(grad_logp[tile_rows]))
            grad_logits.scatter_add_(1, column, onehot_grad[:, None])
            grad_logits /= ctx.temperature
            if grad_hidden_rows is not None:
                grad_hidden_rows[tile_rows].addmm_(grad_logits, weight_tile)
            if grad_weight is not None:
                grad_weight[columns].addmm_(grad_logits.T, hidden_rows[tile_rows])
            if grad_bias is not None:
                grad_bias[columns] += grad_logits.sum(dim=0)
        return (
            None if grad_hidden_rows is None else grad_hidden_rows.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def _counted_rows(hidden, labels, ignore_index, accumulate):
    """(labels, hidden states in ``accumulate``, padding mask) of every row, the rows whose
    label is ignored zeroed (label 0, hidden 0: finite whatever padding held), to be masked
    out of the outputs and gradients."""
    padding = labels == ignore_index
    return labels.long().masked_fill(padding, 0), hidden.to(accumulate).masked_fill(padding[:, None], 0), padding


def _logit_tiles(hidden, weight, bias, temperature):
    """Yields (token slice, vocabulary slice, head tile, logits tile) over the [N, V] grid,
    vocabulary outermost so each head tile is cast to the accumulation dtype once."""
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    for v0 in range(0, vocab, VOCAB_TILE):
        columns = slice(v0, min(v0 + VOCAB_TILE, vocab))
        weight_tile = weight[columns].to(hidden.dtype)
        bias_tile = None if bias is None else bias[columns].to(hidden.dtype)
        # Counted in tiles and sliced past the end (a slice stops there): under
        # torch.compile with a dynamic token count this guards on the count of tiles,
        # not on the exact count of tokens, as range(0, num_tokens, TOKEN_TILE) would.
        for tile in range((num_tokens + TOKEN_TILE - 1) // TOKEN_TILE):
            rows = slice(tile * TOKEN_TILE, (tile + 1) * TOKEN_TILE)
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


def tiled_token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N] (fp32, or fp64 for fp64 inputs) (and entropy [N]) of ``labels``
    under softmax(h W^T / temperature); ignored rows give 0 and no gradient."""
    return _TiledLinearLogprob.apply(
        hidden_states, lm_head_weight, lm_head_bias, labels, float(temperature), ignore_index, with_entropy
    )
