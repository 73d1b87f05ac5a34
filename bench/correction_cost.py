"""The linear loss's time with each kind of rollout correction and token mask (docs/benchmarks.md,
"The rollout correction's cost"): one process, hadw[cpp], fp32, the cases in a shuffled order
each round, median forward + backward. Run alone: ``python bench/correction_cost.py``."""

import functools
import time

import torch
from interleaved import interleaved_medians

from hadw_kernels import RolloutCorrection, fused_linear_hadw_grpo_loss

PROMPTS, GROUP, WIDTH, HIDDEN, VOCAB = 1, 8, 256, 512, 32768
ROUNDS = 9


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    rows = PROMPTS * GROUP
    hidden = torch.randn(rows, WIDTH, HIDDEN) / HIDDEN**0.5
    weight = torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5
    labels = torch.randint(0, VOCAB, (rows, WIDTH))
    mask = torch.ones(rows, WIDTH, dtype=torch.bool)
    with torch.no_grad():
        old = (hidden @ weight.T).log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    rollout = (old + 0.02 * torch.randn(rows, WIDTH)).clamp(max=0)
    rewards = torch.rand(rows)
    cases = {
        "none (gradients in forward)": {},
        "RolloutCorrection() (TRL's default)": dict(rollout_correction=RolloutCorrection(), rollout_logprobs=rollout),
        "token IcePop, normalised, two filters": dict(rollout_correction=RolloutCorrection(
            level="token", rule="mask", lower=0.5, upper=2.0, batch_normalize=True,
            rejection={"seq_mean_k3": 0.01, "token_k1": (0.5, 2.0)}), rollout_logprobs=rollout),
        "off-policy mask": dict(off_policy_mask_threshold=0.05, rollout_logprobs=rollout),
        "entropy mask, top_entropy_quantile=0.2": dict(top_entropy_quantile=0.2),
        "none, linear_path='recompute'": dict(linear_path="recompute"),
    }

    def step(options) -> float:
        leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        start = time.perf_counter()
        loss = fused_linear_hadw_grpo_loss(*leaves, labels, old, rewards, mask, group_size=GROUP, anchor=0.5,
                                           backend="cpp", **options)
        loss.backward()
        return time.perf_counter() - start

    medians = interleaved_medians({name: functools.partial(step, options) for name, options in cases.items()}, ROUNDS)
    base = medians["none (gradients in forward)"]
    print("| rules | ms | vs none |\n| --- | --- | --- |")
    for name, median in medians.items():
        print(f"| {name} | {median * 1000:.0f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
