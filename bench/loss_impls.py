"""The loss steps the benchmarks compare, each built from the same seeded inputs: the one
registry of implementations and of the bound, for the CPU benchmark (``pytest bench/``:
matrix.py, worker.py) and the GPU check's loss-step, surrogate and paper-scale sections
(gpu_check.py).

A step is one forward and backward of a GRPO loss: from hidden states [B, T, H] and the
LM head [V, H] (the "hidden" input), or from per-token log-probs [B, T] (the "logprobs"
input, the part of the loss that is left once a trainer has the log-probs). It leaves no
gradient behind (as a trainer's ``zero_grad(set_to_none=True)``), so every step allocates
the same. The inputs are fp32 on the CPU unless ``make_inputs`` is given a device and a
dtype (the GPU check: CUDA, bf16 or fp32); the steps run on whatever device the inputs
are on.

    bound        the three GEMMs any exact method needs (logits, the hidden states'
                 and the LM head's gradients) on preallocated buffers, of the valid rows
                 alone (gathered once): the physical limit
    eager        materialised logits [B, T, V], fp32 log_softmax, gather, then the
                 clipped surrogate in plain PyTorch (verl's default path)
    hadw[<b>]    this library, backend <b>, with HA-DW on (anchor 0.5), the default path
                 (gradients formed in the forward where the backend has it);
                 hadw[<b>,<path>] forces a linear path ("recompute",
                 "gradients_in_forward"); ``build_step``'s keywords go to the library's
                 call (the GPU check's ``block_rows``, ``check_values=False``)
    liger        liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (chunked, torch.compile)
    cce          cut_cross_entropy.linear_cross_entropy(impl="torch_compile") for
                 logp = -nll, then the plain surrogate
    trl          TRL 1.16's own chunked fused LM head (trl.kernels.ChunkedLogProbFunction,
                 the GRPO trainer's log-prob path, its chunk size: 32768 tokens where
                 trl.trainer does not import, e.g. without ``datasets``) for logp, then
                 the plain surrogate

and, on CUDA only (their Triton kernels need it: the CPU benchmark leaves them out, see
PEERS; on a GPU the CCE row is its own kernel's):

    cce_kernel   Cut Cross-Entropy's own kernel, linear_cross_entropy(impl="cce"), with
                 padding as its ignore_index (its kernel skips those rows, as a trainer
                 on a GPU feeds it), then the plain surrogate
    liger_triton Liger's Triton GRPO op (liger_kernel.transformers.grpo_loss.
                 triton_grpo_loss) on materialised logits h @ W.T of T + 1 positions
                 (a causal LM's output; the op drops the last), then the token mean
                 per response and the mean over responses

A "dense" case is the first mini-batch of a GRPO step: on-policy (old log-probs = the
current ones, ratio 1), no padding, every token with a gradient. Otherwise responses are
padded to T from lengths in [T/2, T] and the behaviour policy differs a little; or, in a
"long-tail" case, their lengths are lognormal (sigma 1, mean about T/10, capped at T,
the first response T long: reasoning traces), padded to T, or "packed" without padding
(per-token tensors [N] and cu_seqlens: docs/options.md, "Packed batches"); or, in the
GPU check's "half padding" cases, on-policy with every response T/2 long. Liger's GRPO
loss and op take padded [B, T] only; TRL's and CCE's log-probs take the packed rows as
they take any rows.

Peers and backends are imported only when their case runs, so a missing or broken one
fails its own case (reported in the table) and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

INPUTS = ("hidden", "logprobs")
BASELINE = "eager"
BOUND = "bound"
# The plain GRPO clip range, as TRL's and verl's defaults.
EPSILON = 0.2
# HA-DW's difficulty belief: any value in (0, 1) costs the same.
ANCHOR = 0.5
# Cut Cross-Entropy's label of a token outside the loss.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Peer:
    """Another library's loss step, timed beside this library's."""

    impl: str  # its name for build_step
    # Its row in the GPU check's loss-step tables (docs/benchmarks.md, "On a GPU"); None: not timed
    # there (CCE's torch.compile path, which CCE's own kernel stands for on a GPU).
    gpu_label: str | None
    # Its Triton kernels need CUDA: the CPU benchmark (matrix.py) leaves it out, since
    # Triton's interpreter would time nothing a GPU does, and CCE's kernel fails under it.
    cuda_only: bool = False


# The peers, in their rows' order in the CPU benchmark's tables and the GPU check's.
PEERS = (
    Peer("liger", "liger chunked"),
    Peer("liger_triton", "liger triton op", cuda_only=True),
    Peer("cce", None),
    Peer("cce_kernel", "cce + surrogate", cuda_only=True),
    Peer("trl", "trl chunked + surrogate"),
)
# The peers the CPU benchmark times.
CPU_PEERS = tuple(peer.impl for peer in PEERS if not peer.cuda_only)


@dataclass(frozen=True)
class Shape:
    prompts: int
    group_size: int
    length: int
    hidden: int
    vocab: int

    @property
    def batch(self) -> int:
        return self.prompts * self.group_size

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    @property
    def label(self) -> str:
        return f"P{self.prompts} G{self.group_size} T{self.length} H{self.hidden} V{self.vocab}"

    def as_args(self) -> list[str]:
        return [
            "--prompts", str(self.prompts), "--group-size", str(self.group_size),
            "--length", str(self.length), "--hidden", str(self.hidden), "--vocab", str(self.vocab),
        ]


def hadw_impl(backend: str, path: str | None = None) -> str:
    return f"hadw[{backend}]" if path is None else f"hadw[{backend},{path}]"


def backend_of(impl: str) -> str | None:
    """The library backend an implementation name runs, or None for a baseline or peer."""
    if impl.startswith("hadw[") and impl.endswith("]"):
        return impl[len("hadw["):-1].split(",")[0]
    return None


def linear_path_of(impl: str) -> str:
    inner = impl[len("hadw["):-1].split(",")
    return inner[1] if len(inner) > 1 else "auto"


def plain_group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + 1e-6)).view(-1)


def plain_grpo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """GRPO's clipped surrogate, token mean per response then mean over responses."""
    advantages = plain_group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = torch.clamp(ratio, 1.0 - EPSILON, 1.0 + EPSILON)
    token_loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    mask = response_mask.to(token_loss.dtype)
    per_response = (token_loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_response.mean()


def plain_grpo_surrogate_packed(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """The same on packed tokens [N] (every token valid), each segment one response: what
    a padding-free trainer writes without this library (verl's remove-padding path)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    advantages = plain_group_advantages(rewards, group_size)[segment]
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = torch.clamp(ratio, 1.0 - EPSILON, 1.0 + EPSILON)
    token_loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    per_response = torch.zeros(lengths.numel(), dtype=token_loss.dtype, device=token_loss.device).index_add(
        0, segment, token_loss)
    return (per_response / lengths.clamp(min=1)).mean()


def eager_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.T
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@dataclass
class Inputs:
    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    labels: torch.Tensor | None
    logprobs: torch.Tensor | None
    old_logprobs: torch.Tensor | None  # None: on-policy (the detached current log-probs)
    rewards: torch.Tensor
    response_mask: torch.Tensor

    cu_seqlens: torch.Tensor | None = None  # packed: the segments' offsets

    def leaves(self) -> list[torch.Tensor]:
        return [t for t in (self.hidden, self.weight, self.logprobs) if t is not None]

    def old(self, logprobs: torch.Tensor) -> torch.Tensor:
        return logprobs.detach() if self.old_logprobs is None else self.old_logprobs


# A long-tailed case's lognormal lengths: sigma, and the mean as a fraction of T.
LONG_TAIL_SIGMA = 1.0
LONG_TAIL_MEAN_FRACTION = 0.1


def response_lengths(shape: Shape, lengths: str, seed: int = 0) -> torch.Tensor:
    """[B] response lengths (on the CPU): "dense" (all T), "half" (all T/2), "uniform"
    (in [T/2, T]) or "long_tail" (lognormal, mean about T/10, in [1, T], the first one T)."""
    generator = torch.Generator().manual_seed(seed + 1)
    batch, length = shape.batch, shape.length
    if lengths == "dense":
        return torch.full((batch,), length)
    if lengths == "half":
        return torch.full((batch,), length // 2)
    if lengths == "uniform":
        return torch.randint(length // 2, length + 1, (batch,), generator=generator)
    if lengths != "long_tail":
        raise ValueError(f"unknown length distribution {lengths!r}")
    mu = math.log(LONG_TAIL_MEAN_FRACTION * length) - LONG_TAIL_SIGMA**2 / 2
    drawn = torch.exp(mu + LONG_TAIL_SIGMA * torch.randn(batch, generator=generator, dtype=torch.float64))
    drawn = drawn.round().clamp(1, length).long()
    drawn[0] = length
    return drawn


def make_inputs(shape: Shape, input_kind: str, dense: bool = False, seed: int = 0, lengths: str | None = None,
                packed: bool = False, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Inputs:
    """The seeded inputs of a case. Labels are valid everywhere (padding is masked, as TRL
    and verl do), so every padded implementation computes the same [B*T, V] products.
    ``dense``: on-policy (old log-probs None) and, unless ``lengths`` says otherwise, no
    padding; ``lengths``: the distribution (:func:`response_lengths`; default dense or
    uniform); ``packed``: the responses' tokens in segments, no padding. ``dtype``: of
    the hidden states and the head, or of the log-probs and old log-probs (rewards stay
    fp32); drawn in fp32 on ``device``'s generator, then cast, so a dtype changes no draw."""
    generator = torch.Generator(device=device).manual_seed(seed)
    batch, length = shape.batch, shape.length
    # Uniform-ish log-probs around -log V, and a behaviour policy a little off them, so
    # that some ratios leave the clip range.
    typical_logprob = -math.log(shape.vocab)
    old_logprobs = None
    if not dense:
        old_logprobs = typical_logprob + 0.1 * torch.randn(batch, length, generator=generator, device=device)
    rewards = torch.bernoulli(torch.full((batch,), 0.5, device=device), generator=generator)
    rewards[:2] = torch.tensor([0.0, 1.0], device=device)  # a one-group batch still has a gradient
    response_mask = (torch.arange(length)[None, :] < response_lengths(
        shape, lengths or ("dense" if dense else "uniform"), seed)[:, None]).to(device)
    cu_seqlens = None
    if packed:
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), response_mask.sum(dim=1).cumsum(0)])

    def layout(values: torch.Tensor) -> torch.Tensor:
        return values[response_mask] if packed else values

    if old_logprobs is not None:
        old_logprobs = layout(old_logprobs).to(dtype)
    mask = layout(response_mask)
    if input_kind == "logprobs":
        logprobs = layout(typical_logprob + 0.1 * torch.randn(batch, length, generator=generator, device=device))
        return Inputs(None, None, None, logprobs.to(dtype).requires_grad_(), old_logprobs, rewards, mask, cu_seqlens)
    hidden = layout(torch.randn(batch, length, shape.hidden, generator=generator, device=device))
    weight = torch.randn(shape.vocab, shape.hidden, generator=generator, device=device) / math.sqrt(shape.hidden)
    labels = layout(torch.randint(0, shape.vocab, (batch, length), generator=generator, device=device))
    return Inputs(hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels, None, old_logprobs,
                  rewards, mask, cu_seqlens)


Step = Callable[[Inputs], None]


def build_step(impl: str, input_kind: str, shape: Shape, packed: bool = False, loss_type: str = "grpo",
               **options) -> Step:
    """One forward + backward of an implementation with ``loss_type`` (this library's
    preset; Liger's of the same name); imports its package (ImportError if missing;
    ValueError if it takes no packed batch, or no such loss type). ``options``: more
    keywords of this library's loss call (a peer or the baseline takes none)."""
    if options and backend_of(impl) is None:
        raise ValueError(f"{impl} takes no options of this library's call, got {sorted(options)}")
    if impl == BOUND:
        return _bound_step(shape)
    if loss_type != "grpo" and impl not in ("liger",) and backend_of(impl) is None:
        raise ValueError(f"{impl} runs GRPO only here (the baseline the objectives are timed against)")
    loss_fn = _build_loss(impl, input_kind, shape, packed, loss_type, options)

    def step(x: Inputs) -> None:
        loss_fn(x).backward()
        for leaf in x.leaves():
            leaf.grad = None

    return step


def plain_surrogate(logprobs, x: Inputs, group_size: int) -> torch.Tensor:
    """The plain GRPO surrogate of ``x``'s layout."""
    if x.cu_seqlens is not None:
        return plain_grpo_surrogate_packed(logprobs, x.old(logprobs), x.rewards, x.cu_seqlens, group_size)
    return plain_grpo_surrogate(logprobs, x.old(logprobs), x.rewards, x.response_mask, group_size)


def _bound_step(shape: Shape) -> Step:
    buffers = {}

    def step(x: Inputs) -> None:
        weight = x.weight.detach()
        if not buffers:
            # The valid rows are gathered once, beside the outputs: the bound is the GEMMs
            # alone (on a GPU, a boolean index would also wait for the host every step).
            hidden = x.hidden.detach().reshape(-1, shape.hidden)[x.response_mask.reshape(-1)]
            buffers["hidden"] = hidden
            buffers["logits"] = hidden.new_empty(hidden.shape[0], shape.vocab)
            buffers["grad_hidden"] = torch.empty_like(hidden)
            buffers["grad_weight"] = torch.empty_like(weight)
        hidden = buffers["hidden"]
        torch.mm(hidden, weight.T, out=buffers["logits"])
        torch.mm(buffers["logits"], weight, out=buffers["grad_hidden"])
        torch.mm(buffers["logits"].T, hidden, out=buffers["grad_weight"])

    return step


# Liger's loss types (TRL's): their clip range as TRL recommends it (CISPO's epsilon_high
# is its cap, 5), the same as this library's presets.
LIGER_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _build_loss(impl: str, input_kind: str, shape: Shape, packed: bool, loss_type: str,
                options: dict) -> Callable[[Inputs], torch.Tensor]:
    group_size = shape.group_size
    backend = backend_of(impl)
    if backend is not None:
        import hadw_kernels

        # Dr.GRPO's constant length: the padded width (a packed batch has none).
        length = dict(max_response_length=shape.length) if loss_type == "dr_grpo" else {}
        if input_kind == "logprobs":
            return lambda x: hadw_kernels.fused_hadw_grpo_loss(
                x.logprobs, x.old_logprobs, x.rewards, x.response_mask, cu_seqlens=x.cu_seqlens,
                group_size=group_size, loss_type=loss_type, anchor=ANCHOR, backend=backend, **length, **options,
            )
        return lambda x: hadw_kernels.fused_linear_hadw_grpo_loss(
            x.hidden, x.weight, x.labels, x.old_logprobs, x.rewards, x.response_mask, cu_seqlens=x.cu_seqlens,
            group_size=group_size, loss_type=loss_type, anchor=ANCHOR, backend=backend,
            linear_path=linear_path_of(impl), **length, **options,
        )
    if impl == BASELINE:
        if input_kind == "logprobs":
            return lambda x: plain_surrogate(x.logprobs, x, group_size)
        return lambda x: plain_surrogate(eager_token_logprobs(x.hidden, x.weight, x.labels), x, group_size)
    if input_kind != "hidden":
        raise ValueError(f"{impl} takes hidden states only")
    if impl in ("liger", "liger_triton") and packed:
        raise ValueError("Liger's GRPO loss takes padded [B, T] batches only")
    if impl == "liger":
        if loss_type not in LIGER_LOSS_TYPES:
            raise ValueError(f"Liger's GRPO loss has no loss type {loss_type!r}")
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # TRL's settings: no reference model.
        liger_loss = LigerFusedLinearGRPOLoss(
            beta=0.0, use_ref_model=False, loss_type=loss_type, epsilon_low=EPSILON,
            epsilon_high=5.0 if loss_type == "cispo" else EPSILON,
        )

        def liger_step(x: Inputs) -> torch.Tensor:
            advantages = plain_group_advantages(x.rewards, group_size)
            # old_per_token_logps=None: Liger's on-policy default (the detached current ones).
            loss, _metrics = liger_loss(
                x.hidden, x.weight, x.labels, x.response_mask.float(), advantages,
                old_per_token_logps=x.old_logprobs,
            )
            return loss

        return liger_step
    if impl == "liger_triton":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def liger_triton_step(x: Inputs) -> torch.Tensor:
            logits = x.hidden @ x.weight.T
            # A causal LM's logits: T + 1 positions, of which the op drops the last.
            logits = torch.cat([logits, logits[:, -1:]], dim=1)
            mask = x.response_mask.float()
            per_token, _, _ = triton_grpo_loss(
                logits, x.old_logprobs, None, x.labels, plain_group_advantages(x.rewards, group_size), mask,
                temperature=1.0, beta=0.0, eps_low=EPSILON, eps_high=EPSILON, loss_type="grpo",
            )
            return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()

        return liger_triton_step
    if impl in ("cce", "cce_kernel"):
        from cut_cross_entropy import linear_cross_entropy

        kernel = "torch_compile" if impl == "cce" else "cce"

        def cce_step(x: Inputs) -> torch.Tensor:
            labels = x.labels if impl == "cce" else x.labels.masked_fill(~x.response_mask, IGNORE_INDEX)
            logprobs = -linear_cross_entropy(x.hidden, x.weight, labels, impl=kernel, reduction="none")
            return plain_surrogate(logprobs, x, group_size)

        return cce_step
    if impl == "trl":
        from trl.kernels import ChunkedLogProbFunction

        try:
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk_size
        except ImportError:  # trl.trainer imports datasets; TRL 1.16's GRPO trainer's chunk
            chunk_size = 32768

        def trl_step(x: Inputs) -> torch.Tensor:
            # The GRPO trainer asks for the entropy too (logging, entropy masking).
            logprobs, *_ = ChunkedLogProbFunction.apply(
                x.hidden.reshape(-1, x.hidden.shape[-1]), x.weight, None, x.labels.reshape(-1), 1.0,
                chunk_size, None, 1.0, ("entropy",),
            )
            return plain_surrogate(logprobs.view(x.labels.shape), x, group_size)

        return trl_step
    raise ValueError(f"unknown implementation {impl!r}")
