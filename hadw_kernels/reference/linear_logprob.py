"""Log-probs (and entropy) of labels from hidden states and the LM head (docs/math.md, section 6).

``token_logprobs_reference`` materialises the [N, V] logits, as eager trainers do: it
is the reference the chunked and fused paths are tested against, never a fast path.
The logits are formed in the inputs' dtype (as a bf16 model's LM head would) and the
log-softmax runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tables.linear_blocks import IGNORE_INDEX
from ..tables.precision import accumulate_dtype


def token_logprobs_reference(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp(label) [N] and, optionally, the entropy [N] of softmax(h W^T / temperature).

    Positions whose label is ``ignore_index`` get 0 for both, and no gradient.
    """
    logits = F.linear(hidden_states, lm_head_weight, lm_head_bias)
    logits = logits.to(accumulate_dtype(logits.dtype)) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).long()
    logp = log_probs.gather(-1, safe_labels[:, None]).squeeze(-1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    entropy = None
    if with_entropy:
        # p log p is 0 where p = 0 (a -inf logit: vocabulary masking), not 0 * -inf = NaN;
        # log p is zeroed before the product so that its gradient is 0 there too
        # (docs/math.md, section 8, "Entropy").
        finite_log_probs = torch.where(log_probs == float("-inf"), torch.zeros_like(log_probs), log_probs)
        entropy = -(log_probs.exp() * finite_log_probs).sum(-1)
        entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
    return logp, entropy
