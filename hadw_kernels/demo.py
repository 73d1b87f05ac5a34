"""A short demo of the loss on random data: ``python -m hadw_kernels.demo``.

Simulates a few rollout batches whose accuracy drifts upward, updates the difficulty
anchor once per batch, and prints the loss, its metrics and the anchor's figures.
"""

from __future__ import annotations

import argparse

import torch

from . import DifficultyAnchor, fused_linear_hadw_grpo_loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--loss-type", default="grpo")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    generator = torch.Generator().manual_seed(args.seed)
    batch = args.prompts * args.group_size
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    anchor = DifficultyAnchor()
    for step in range(1, args.steps + 1):
        hidden = torch.randn(batch, args.length, args.hidden, generator=generator, requires_grad=True)
        labels = torch.randint(0, args.vocab, (batch, args.length), generator=generator)
        lengths = torch.randint(args.length // 4, args.length + 1, (batch,), generator=generator)
        mask = torch.arange(args.length)[None, :] < lengths[:, None]
        old_logprobs = torch.full((batch, args.length), -torch.log(torch.tensor(float(args.vocab))).item())
        # Each prompt has its own difficulty; the policy improves a little every step.
        accuracy = torch.rand(args.prompts, generator=generator).repeat_interleave(args.group_size)
        accuracy = (accuracy + 0.05 * step).clamp(max=1.0)
        rewards = torch.bernoulli(accuracy, generator=generator)
        belief = anchor.update(rewards)
        loss, metrics = fused_linear_hadw_grpo_loss(
            hidden, head.weight, labels, old_logprobs, rewards, mask,
            group_size=args.group_size, loss_type=args.loss_type, anchor=belief,
            backend=args.backend, return_metrics=True,
        )
        loss.backward()
        shown = {k: round(v.item(), 4) for k, v in metrics.items()}
        figures = {k.split("/")[1]: (None if v is None else round(v, 4)) for k, v in anchor.figures().items()}
        print(f"step {step}: loss {loss.item():+.5f}  |grad W| {head.weight.grad.norm():.4f}")
        print(f"  metrics {shown}")
        print(f"  anchor  {figures}")
        head.weight.grad = None


if __name__ == "__main__":
    main()
