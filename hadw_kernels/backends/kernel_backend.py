"""A backend made of kernels behind the hadw:: ops (Triton, C++): its calls are op calls
with the backend's name, which the dispatcher routes (``ops.routing``)."""

from __future__ import annotations

import torch

from .. import ops
from ..batch.inputs import LinearHead, SurrogateBatch
from ..checks.arguments import detached
from ..tables.metrics import GROUP_METRICS, METRIC_NAMES
from ..tables.precision import accumulate_dtype


def name_metrics(metrics: torch.Tensor, *, with_groups: bool, with_kl: bool, with_entropy: bool) -> dict:
    """The metrics vector (``metrics.METRIC_NAMES`` order) as a dict of the metrics that
    apply to this call."""
    named = dict(zip(METRIC_NAMES, metrics.detach().unbind()))
    dropped: set[str] = set()
    if not with_groups:
        dropped.update(GROUP_METRICS)
    if not with_kl:
        dropped.add("ref_kl")
    if not with_entropy:
        dropped.add("entropy_mean")
    return {name: value for name, value in named.items() if name not in dropped}


def anchor_tensor(anchor, device: torch.device) -> torch.Tensor | None:
    if anchor is None:
        return None
    if isinstance(anchor, torch.Tensor):
        return anchor.detach()  # data, as every input but the log-probs and the entropy
    # torch.full, not torch.tensor: no blocking host-to-device copy on CUDA. float64: a
    # Python float is a double, and fp32 would round it for fp64 inputs.
    if torch.compiler.is_compiling():
        # A float argument is symbolic here; filling a tensor with it would specialise the
        # graph to its value (a recompile each step as the anchor moves), adding it does not.
        return torch.zeros((), dtype=torch.float64, device=device) + anchor
    return torch.full((), float(anchor), dtype=torch.float64, device=device)


def op_arguments(op: str, batch: SurrogateBatch, head: LinearHead | None = None, agg_weights=None, **formed) -> dict:
    """``hadw::<op>``'s arguments by their schema names (``ops/signatures.py``), from a
    call's batch: the one place a batch becomes op arguments. Its tensors detached (the
    op forms the gradients, which the caller attaches), the anchor as a tensor, the
    estimator's inputs (the batch's totals, the prompts' pseudo-counts), the
    reference log-probs where a KL term reads them, its config's options as the schemas
    take them (``LossConfig.kernel_options``); with ``head`` the linear sweep's
    (``linear_surrogate_forward``), whose per-token inputs (``agg_weights``, each token's
    aggregation weight, among them) are its rows, contiguous in the compute type (its
    kernels index them directly); ``formed``: the rest of what the call chose (whether
    the sweep forms the entropy, the backend's name)."""
    config = batch.config
    if head is None:
        per_token = detached
    else:
        compute = accumulate_dtype(head.hidden.dtype)

        def per_token(values):
            return None if values is None else values.detach().to(compute).contiguous()

    arguments = {
        "logprobs": detached(batch.logprobs),
        "old_logprobs": per_token(batch.old_logprobs),
        "response_mask": batch.mask,
        "cu_seqlens": batch.layout.cu_seqlens,
        "rewards": detached(batch.rewards),
        "advantages": per_token(batch.advantages),
        "response_advantages": detached(batch.response_advantages),
        "anchor": anchor_tensor(batch.anchor, batch.mask.device),
        "ref_logprobs": None if config.beta <= 0 else per_token(batch.ref_logprobs),
        "importance_weights": per_token(batch.importance_weights),
        "entropy": detached(batch.entropy),
        "selected": batch.selected,
        "batch_totals": detached(batch.batch_totals),
        "prior": detached(batch.prior),
        "agg_weights": per_token(agg_weights),
        **config.kernel_options(),
        **formed,
    }
    if head is not None:
        arguments.update(
            hidden=head.hidden.detach(), weight=head.weight.detach(), bias=detached(head.bias), labels=head.labels,
            temperature=float(head.temperature), ignore_index=head.ignore_index, block_rows=head.block_rows or 0,
        )
    return {name: arguments[name] for name in ops.argument_names(op)}


class KernelBackend:
    """Kernels registered for the hadw:: ops under ``name`` (see ``ops.register_kernel``)."""

    def __init__(self, name: str, scale_in_place=None, compacts_rows: bool = False) -> None:
        self.name = name
        # How the gradients formed in the forward are scaled by the upstream gradient
        # (``ops.attach_single_use_gradients``); None: ``mul_``.
        self.scale_in_place = scale_in_place
        # Whether the kernels leave rows whose label is ignored out of their GEMMs
        # themselves (backends/protocol.py).
        self.compacts_rows = compacts_rows

    def serves(self, device: torch.device) -> bool:
        # A device's type as it is (building a torch.device again costs a small call more).
        return ops.serves(self.name, device.type if isinstance(device, torch.device) else torch.device(device).type)

    def unavailable_message(self, device: torch.device) -> str:
        return ops.unavailable_message(self.name, device)

    def has_gradients_in_forward(self, device: torch.device) -> bool:
        return ops.has_kernel("linear_surrogate_forward", self.name, torch.device(device).type)

    def surrogate_loss(self, batch: SurrogateBatch):
        # The op forms its gradient with respect to the log-probs (and the entropy) in the
        # forward; it is attached below.
        loss, grad_logprobs, grad_entropy, metrics, grad_scale = ops.call(
            "surrogate_loss", **op_arguments("surrogate_loss", batch, backend=self.name))
        entropy = batch.entropy
        loss = ops.attach_gradients(
            loss, [batch.logprobs, entropy], [grad_logprobs, None if entropy is None else grad_entropy],
            # 0-d where the gradients leave token-mean's 1 / N_tok to it (ops/schemas.py): a
            # shape, known without reading a value.
            grad_scale if grad_scale.dim() == 0 else None,
        )
        if not batch.with_metrics:
            return loss, {}
        return loss, name_metrics(metrics, with_groups=batch.rewards is not None, with_kl=batch.config.beta > 0,
                                  with_entropy=entropy is not None)

    def token_logprobs(self, hidden_states, lm_head_weight, labels, *, lm_head_bias, temperature, ignore_index,
                       with_entropy):
        logprobs, entropy, _, _ = ops.call(
            "linear_logprob_forward",
            hidden=hidden_states, weight=lm_head_weight, bias=lm_head_bias, labels=labels,
            temperature=float(temperature), ignore_index=ignore_index, with_entropy=with_entropy,
            backend=self.name,
        )
        return logprobs, entropy if with_entropy else None

    def linear_surrogate(self, head: LinearHead, batch: SurrogateBatch, agg_weights, with_entropy):
        """Per-row log-probs, entropy and the gradients of the token-level surrogate
        with respect to the hidden states, the head and the bias, in one sweep."""
        return ops.call("linear_surrogate_forward", **op_arguments(
            "linear_surrogate_forward", batch, head, agg_weights=agg_weights, with_entropy=with_entropy,
            backend=self.name))
