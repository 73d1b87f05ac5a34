"""The prefix tree's attention on the CPU, three ways (docs/benchmarks.md, "The prefix
tree's attention"): the segment attention's batched sdpa over buckets of equal-shape
segments (what ``Segments.attend`` runs), FlexAttention with a block mask of the same
rule (compiled; eager FlexAttention is a reference implementation that forms every
score), and one sdpa call under the dense [N, N] mask (what transformers forms for a
packed row). One layer's attention, float32, interleaved rounds (``interleaved.py``):
the forward of all three, and forward and backward of those that have a backward here
(FlexAttention has none on the CPU in torch 2.13), on the tree of the TRL benchmark's
system-prompt case: a 1,000-token system prompt, four prompts of 64 more tokens, eight
64-token responses each.

    .venv/bin/python bench/tree_attention.py --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from interleaved import interleaved_times
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from hadw_kernels.layouts import LAYOUTS


def tree_segments(system: int, prompts: int, question: int, group: int, response: int):
    generator = random.Random(0)

    def tokens(count):
        return [generator.randrange(3, 1000) for _ in range(count)]

    preamble = tokens(system)
    rows_prompts, rows_responses = [], []
    for _ in range(prompts):
        prompt = preamble + tokens(question)
        for _ in range(group):
            rows_prompts.append(prompt)
            rows_responses.append(tokens(response))
    return LAYOUTS["prefix_tree"].build(rows_prompts, rows_responses).attention_segments


def dense_mask(segments) -> torch.Tensor:
    allowed = torch.zeros(segments.tokens, segments.tokens, dtype=torch.bool)
    for start, length, spans in zip(segments.starts, segments.lengths, segments.prefixes):
        for prefix, prefix_length in spans:
            allowed[start:start + length, prefix:prefix + prefix_length] = True
        allowed[start:start + length, start:start + length] = torch.ones(length, length, dtype=torch.bool).tril()
    return allowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    segments = tree_segments(system=1000, prompts=4, question=64, group=8, response=64)
    tokens = segments.tokens
    allowed = dense_mask(segments)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, tokens, args.head_dim, generator=generator).requires_grad_()
               for _ in range(3))
    upstream = torch.randn(1, tokens, args.heads, args.head_dim, generator=generator)
    block_mask = create_block_mask(lambda b, h, query, key: allowed[query, key], 1, 1, tokens, tokens, device="cpu")
    compiled = torch.compile(flex_attention)

    # FlexAttention on the CPU refuses inputs that require grad, even under no_grad.
    frozen = [t.detach() for t in (q, k, v)]

    def timed(attention, backward):
        def step():
            started = time.perf_counter()
            if backward:
                attention(q, k, v).backward(upstream)
            else:
                with torch.no_grad():
                    attention(*frozen)
            return time.perf_counter() - started
        return step

    ways = {
        "segment attention (bucketed sdpa)": lambda q, k, v: segments.attend(q, k, v, scaling=None, dropout=0.0),
        "FlexAttention, compiled, block mask": lambda q, k, v: compiled(
            q, k, v, block_mask=block_mask).transpose(1, 2),
        "sdpa, dense [N, N] mask": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed).transpose(1, 2),
    }
    with torch.no_grad():  # the three compute one rule
        ours = ways["segment attention (bucketed sdpa)"](*frozen)
        for name, way in ways.items():
            error = float((way(*frozen) - ours).abs().max())
            assert error < 1e-4, (name, error)
    with_backward = {}
    for name, way in ways.items():
        try:
            way(q, k, v).backward(upstream)
            with_backward[name] = way
        except NotImplementedError as error:
            print(f"{name}: no backward here ({str(error).splitlines()[0]})")
    print(f"{tokens} tokens, {len(segments.starts)} segments, mask density {float(allowed.float().mean()):.3f}; "
          f"{args.heads} heads of {args.head_dim}, float32, one thread")
    print("| attention | forward, median s | x segment attention | forward + backward, median s | x segment attention |")
    print("| --- | ---: | ---: | ---: | ---: |")
    forward = interleaved_times({name: timed(way, False) for name, way in ways.items()}, args.rounds)
    both = interleaved_times({name: timed(way, True) for name, way in with_backward.items()}, args.rounds)
    base = "segment attention (bucketed sdpa)"
    for name in ways:
        cells = [f"{statistics.median(forward[name]):.3f}",
                 f"{statistics.median(forward[name]) / statistics.median(forward[base]):.2f}"]
        if name in both:
            cells += [f"{statistics.median(both[name]):.3f}",
                      f"{statistics.median(both[name]) / statistics.median(both[base]):.2f}"]
        else:
            cells += ["no backward on the CPU", ""]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
