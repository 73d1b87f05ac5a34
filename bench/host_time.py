"""The host's share of a small call (docs/benchmarks.md, "Host time of a small call"): the
log-prob loss and the linear loss at B = 8 responses of T = 16 tokens (the linear loss
from hidden states of H = 16 and a head of V = 64) on the CPU, one thread, forward and
backward, where the arithmetic is negligible and what is measured is the Python, the
dispatcher and the operators around the kernels.

Each implementation runs interleaved with the eager loss it replaces, in a shuffled order
each round: for the log-prob loss eager GRPO as TRL writes it (TRL's advantages in, the
token-level clipped surrogate, its per-response token mean), for the linear loss the same
after the logits, their log-softmax and the labels' gather. A fused call runs each layout,
padded [B, T] and packed ([N] tokens and ``cu_seqlens``, the same responses), against the
one eager (which has only the padded one). The report is each one's median time, the
median over the rounds of its time over eager's in the same round (a slow spell of the
machine falls on both), and the operators it dispatches in one forward + backward
(counted by a TorchDispatchMode, the kernels' own ops included).

    .venv/bin/python bench/host_time.py
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch
from interleaved import interleaved_times
from torch.utils._python_dispatch import TorchDispatchMode

from hadw_kernels import available_backends, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss

BATCH, WIDTH, GROUP = 8, 16, 4
HIDDEN, VOCAB = 16, 64
EPSILON = 0.2
ROUNDS = 15
CALLS_PER_ROUND = 200


def trl_grpo_loss(logprobs, old_logprobs, advantages, mask):
    """TRL's GRPOTrainer._compute_loss for loss_type="grpo" at token level, beta = 0."""
    coef_1 = torch.exp(logprobs - old_logprobs)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token_loss = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def eager_linear_grpo_loss(hidden, weight, labels, old_logprobs, advantages, mask):
    """The logits, their log-softmax and the labels' log-probs, then TRL's GRPO loss."""
    logits = hidden @ weight.t()
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    return trl_grpo_loss(logprobs, old_logprobs, advantages, mask)


def batch():
    generator = torch.Generator().manual_seed(0)
    old = -2 - torch.rand(BATCH, WIDTH, generator=generator)
    logprobs = (old + 0.1 * torch.randn(BATCH, WIDTH, generator=generator)).requires_grad_()
    lengths = torch.randint(1, WIDTH + 1, (BATCH,), generator=generator)
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    advantages = torch.randn(BATCH, generator=generator)
    hidden = torch.randn(BATCH, WIDTH, HIDDEN, generator=generator).requires_grad_()
    weight = (0.1 * torch.randn(VOCAB, HIDDEN, generator=generator)).requires_grad_()
    labels = torch.randint(0, VOCAB, (BATCH, WIDTH), generator=generator)
    return dict(logprobs=logprobs, old=old, advantages=advantages, mask=mask, hidden=hidden, weight=weight,
                labels=labels)


def packed(data: dict) -> dict:
    """The same responses packed: per-token tensors [N] ([N, H]) in segments of WIDTH."""
    tokens = BATCH * WIDTH
    return dict(
        logprobs=data["logprobs"].detach().reshape(tokens).requires_grad_(), old=data["old"].reshape(tokens),
        advantages=data["advantages"], mask=data["mask"].reshape(tokens),
        hidden=data["hidden"].detach().reshape(tokens, HIDDEN).requires_grad_(), weight=data["weight"],
        labels=data["labels"].reshape(tokens), cu_seqlens=torch.arange(BATCH + 1) * WIDTH,
    )


def steps() -> dict[str, dict[str, Callable[[], None]]]:
    """loss -> implementation -> one forward + backward; each loss's first is its eager."""
    layouts = {"padded": batch()}
    layouts["packed"] = packed(layouts["padded"])
    data = layouts["padded"]
    float_mask = data["mask"].float()

    def eager_surrogate():
        trl_grpo_loss(data["logprobs"], data["old"], data["advantages"], float_mask).backward()

    def eager_linear():
        eager_linear_grpo_loss(data["hidden"], data["weight"], data["labels"], data["old"], data["advantages"],
                               float_mask).backward()

    def fused_surrogate(tensors, backend, check_values):
        packing = {"cu_seqlens": tensors["cu_seqlens"]} if "cu_seqlens" in tensors else {}

        def step():
            fused_hadw_grpo_loss(tensors["logprobs"], tensors["old"], None, tensors["mask"],
                                 advantages=tensors["advantages"], loss_type="grpo", backend=backend,
                                 check_values=check_values, **packing).backward()
        return step

    def fused_linear(tensors, backend, check_values):
        packing = {"cu_seqlens": tensors["cu_seqlens"]} if "cu_seqlens" in tensors else {}

        def step():
            fused_linear_hadw_grpo_loss(tensors["hidden"], tensors["weight"], tensors["labels"], tensors["old"], None,
                                        tensors["mask"], advantages=tensors["advantages"], loss_type="grpo",
                                        backend=backend, check_values=check_values, **packing).backward()
        return step

    implementations = {"surrogate": {"eager (TRL's GRPO)": eager_surrogate},
                       "linear": {"eager (logits, log-softmax, TRL's GRPO)": eager_linear}}
    for backend in [name for name in ("cpp", "torch") if name in available_backends()]:
        for layout, tensors in layouts.items():
            for check_values in (True, False):
                name = f"hadw[{backend}], {layout}" + ("" if check_values else ", check_values=False")
                implementations["surrogate"][name] = fused_surrogate(tensors, backend, check_values)
                implementations["linear"][name] = fused_linear(tensors, backend, check_values)
    return implementations


class OperatorCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.operators = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def operator_counts(implementations: dict) -> dict:
    counts = {}
    for name, step in implementations.items():
        step()  # warm: first-call work (imports, caches) is not a call's
        with OperatorCount() as mode:
            step()
        counts[name] = mode.operators
    return counts


def seconds_a_call(step) -> float:
    started = time.perf_counter()
    for _ in range(CALLS_PER_ROUND):
        step()
    return (time.perf_counter() - started) / CALLS_PER_ROUND


def main() -> None:
    torch.set_num_threads(1)
    print(f"B={BATCH} T={WIDTH} (linear: H={HIDDEN} V={VOCAB}), one thread, forward + backward, "
          f"{ROUNDS} interleaved rounds of {CALLS_PER_ROUND} calls (torch {torch.__version__})")
    for loss, implementations in steps().items():
        counts = operator_counts(implementations)
        times = interleaved_times({name: functools.partial(seconds_a_call, step)
                                   for name, step in implementations.items()}, ROUNDS)
        eager_name = next(iter(implementations))
        eager = times[eager_name]
        print(f"\n{loss}:\n| implementation | time a call (median) | x eager (median of rounds) | operators |")
        print("| --- | ---: | ---: | ---: |")
        for name in implementations:
            ratio = statistics.median(mine / theirs for mine, theirs in zip(times[name], eager))
            print(f"| {name} | {statistics.median(times[name]) * 1e6:.0f} us | {ratio:.2f}x | "
                  f"{sum(counts[name].values())} |")
        for name, operators in counts.items():
            print(f"\n{name}: " + ", ".join(f"{op} {n}" for op, n in sorted(operators.items(),
                                                                           key=lambda item: -item[1])))


if __name__ == "__main__":
    main()
