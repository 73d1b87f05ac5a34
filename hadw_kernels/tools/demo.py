"""A short demo of the loss on random data: ``python -m hadw_kernels.tools.demo``.

Simulates a few rollout batches whose accuracy drifts upward, updates the difficulty
anchor once per batch, and prints the loss, its metrics and the anchor's figures.
"""

from __future__ import annotations

import argparse

import torch

from .. import LOSS_TYPES, DifficultyAnchor, available_backends, fused_linear_hadw_grpo_loss
from ..backends import BACKENDS
from .cli import POSITIVE_INT, HelpFormatter, int_at_least, summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hadw_kernels.tools.demo", description=summary(__doc__),
                                     formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=POSITIVE_INT, default=5, help="rollout batches (one loss call each)")
    parser.add_argument("--prompts", type=POSITIVE_INT, default=4, help="prompts per rollout batch")
    parser.add_argument("--group-size", type=int_at_least(2), default=8, help="responses per prompt (G)")
    parser.add_argument("--length", type=POSITIVE_INT, default=64, help="tokens per response, padding included")
    parser.add_argument("--hidden", type=POSITIVE_INT, default=256, help="hidden size H of the random LM head")
    parser.add_argument("--vocab", type=POSITIVE_INT, default=8192, help="vocabulary size V of the random LM head")
    parser.add_argument("--loss-type", choices=LOSS_TYPES, default="grpo", help="the loss's preset")
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default="auto", help="the kernels that run it")
    parser.add_argument("--seed", type=int_at_least(0), default=0,
                        help="seeds everything drawn: the LM head, the batches, the rewards")
    args = parser.parse_args(argv)
    if args.backend != "auto" and args.backend not in available_backends("cpu"):
        parser.error(f"argument --backend: {args.backend!r} cannot run on the CPU here; "
                     f"available: {available_backends('cpu')}")

    generator = torch.Generator().manual_seed(args.seed)
    batch = args.prompts * args.group_size
    # nn.Linear's initialisation, U(-1/sqrt(H), 1/sqrt(H)), drawn from the seeded generator.
    head_weight = ((2 * torch.rand(args.vocab, args.hidden, generator=generator) - 1) / args.hidden**0.5)
    head_weight.requires_grad_()
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
            hidden, head_weight, labels, old_logprobs, rewards, mask,
            group_size=args.group_size, loss_type=args.loss_type, anchor=belief,
            backend=args.backend, return_metrics=True,
        )
        loss.backward()
        shown = {k: round(v.item(), 4) for k, v in metrics.items()}
        figures = {k.split("/")[1]: (None if v is None else round(v, 4)) for k, v in anchor.figures().items()}
        print(f"step {step}: loss {loss.item():+.5f}  |grad W| {head_weight.grad.norm():.4f}")
        print(f"  metrics {shown}")
        print(f"  anchor  {figures}")
        head_weight.grad = None


if __name__ == "__main__":
    main()
