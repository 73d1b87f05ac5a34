"""The host's share of a small call (docs/benchmarks.md, "Host time of a small call"): the
log-prob loss at B = 8 responses of T = 16 tokens on the CPU, one thread, forward and
backward, where the arithmetic is negligible and what is measured is the Python, the
dispatcher and the operators around the kernels. Each implementation runs interleaved
with eager GRPO as TRL writes it (TRL's advantages in, the token-level clipped surrogate,
its per-response token mean), in a shuffled order each round; the report is each one's
median time over eager's, and the operators it dispatches in one forward + backward
(counted by a TorchDispatchMode, the kernels' own ops included).

    .venv/bin/python bench/host_time.py
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hadw_kernels import available_backends, fused_hadw_grpo_loss
from interleaved import interleaved_medians

BATCH, WIDTH, GROUP = 8, 16, 4
EPSILON = 0.2
ROUNDS = 15
CALLS_PER_ROUND = 200


def trl_grpo_loss(logprobs, old_logprobs, advantages, mask):
    """TRL's GRPOTrainer._compute_loss for loss_type="grpo" at token level, beta = 0."""
    coef_1 = torch.exp(logprobs - old_logprobs)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token_loss = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def batch():
    generator = torch.Generator().manual_seed(0)
    old = -2 - torch.rand(BATCH, WIDTH, generator=generator)
    logprobs = (old + 0.1 * torch.randn(BATCH, WIDTH, generator=generator)).requires_grad_()
    lengths = torch.randint(1, WIDTH + 1, (BATCH,), generator=generator)
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    advantages = torch.randn(BATCH, generator=generator)
    return logprobs, old, advantages, mask


def steps() -> dict:
    logprobs, old, advantages, mask = batch()
    float_mask = mask.float()

    def eager():
        trl_grpo_loss(logprobs, old, advantages, float_mask).backward()

    def fused(backend, check_values):
        def step():
            fused_hadw_grpo_loss(logprobs, old, None, mask, advantages=advantages, loss_type="grpo",
                                 backend=backend, check_values=check_values).backward()
        return step

    implementations = {"eager (TRL's GRPO)": eager}
    for backend in [name for name in ("cpp", "torch") if name in available_backends()]:
        implementations[f"hadw[{backend}]"] = fused(backend, True)
        implementations[f"hadw[{backend}], check_values=False"] = fused(backend, False)
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


def seconds_a_call(step) -> Callable[[], float]:
    def timed() -> float:
        started = time.perf_counter()
        for _ in range(CALLS_PER_ROUND):
            step()
        return (time.perf_counter() - started) / CALLS_PER_ROUND

    return timed


def main() -> None:
    torch.set_num_threads(1)
    implementations = steps()
    counts = operator_counts(implementations)
    seconds = interleaved_medians({name: seconds_a_call(step) for name, step in implementations.items()}, ROUNDS)
    eager = seconds["eager (TRL's GRPO)"]
    print(f"B={BATCH} T={WIDTH}, one thread, forward + backward, median of {ROUNDS} rounds of "
          f"{CALLS_PER_ROUND} calls (torch {torch.__version__})")
    print("| implementation | time a call | x eager | operators dispatched |")
    print("| --- | ---: | ---: | ---: |")
    for name in implementations:
        print(f"| {name} | {seconds[name] * 1e6:.0f} us | {seconds[name] / eager:.2f}x | "
              f"{sum(counts[name].values())} |")
    for name, operators in counts.items():
        print(f"\n{name}: " + ", ".join(f"{op} {n}" for op, n in sorted(operators.items(), key=lambda item: -item[1])))


if __name__ == "__main__":
    main()
