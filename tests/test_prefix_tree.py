"""The prefix-tree layout (hadw_kernels/layouts/builders.py, docs/layouts.md) trains as the
padded layout does: on tiny Llama and Qwen2 models in float32, the loss, every metric and
every gradient of two SGD steps agree to 1e-5 relative, for rows in shuffled order that
share runs of tokens at depths 1 to 4 (a system prompt, a prompt, responses that begin
alike and fork again), a row that is a prefix of another's, an exact duplicate, an empty
response and rows sharing nothing; while the model is fed the rows' distinct tokens."""

import random

import pytest
import torch
from test_layouts import VOCAB, tiny_model

from hadw_kernels import fused_linear_hadw_grpo_loss
from hadw_kernels.layouts import LAYOUTS, enable_segment_attention
from hadw_kernels.layouts.tallies import fed_sequence


def forked_rows(depth: int, seed: int):
    """Rows that are root-to-leaf paths of a random tree ``depth`` levels deep (each node a
    run of 1 to 4 tokens, two or three children), each cut into prompt and response at a
    random point, shuffled; then the odd rows a host produces."""
    generator = random.Random(seed)

    def run():
        return [generator.randrange(3, VOCAB) for _ in range(generator.randrange(1, 5))]

    paths = [run()]
    for _ in range(depth):
        paths = [path + run() for path in paths for _ in range(generator.randrange(2, 4))]
    rows = []
    for path in paths:
        cut = generator.randrange(1, len(path))
        rows.append((path[:cut], path[cut:]))
    prompt, response = rows[0]
    rows.append((prompt, response[:1]))  # a prefix of another row
    rows.append((prompt, list(response)))  # a duplicate
    rows.append((rows[1][0], []))  # an empty response
    rows.append(([1, 2], [generator.randrange(3, VOCAB) for _ in range(3)]))  # sharing nothing
    generator.shuffle(rows)
    return [list(prompt) for prompt, _ in rows], [list(response) for _, response in rows]


def loss_and_metrics(model, batch, advantages):
    outputs = model.model(**batch.model_inputs(model), use_cache=False)
    hidden = batch.loss_hidden_states(outputs.last_hidden_state)
    old = torch.full(batch.labels.shape, -2.5)  # a ratio far from 1: clipping applies
    return fused_linear_hadw_grpo_loss(
        hidden, model.lm_head.weight, batch.labels, old, None, batch.response_mask, cu_seqlens=batch.cu_seqlens,
        advantages=batch.per_segment(advantages), loss_type="dapo", return_metrics=True, backend="torch")


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_the_prefix_tree_trains_as_padded_rows_do(architecture, depth):
    prompts, responses = forked_rows(depth, seed=depth)
    advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(depth))
    tree = LAYOUTS["prefix_tree"].build(prompts, responses)
    padded = LAYOUTS["padded"].build(prompts, responses, pad_token_id=0)
    distinct = {tuple(fed_sequence(p, r)[:end]) for p, r in zip(prompts, responses)
                for end in range(1, len(fed_sequence(p, r)) + 1)}
    assert tree.fed_tokens == len(distinct) < sum(len(p) + len(r) for p, r in zip(prompts, responses))
    # The deepest node reads its ancestors' runs, laid out apart (their earlier siblings'
    # subtrees in between).
    assert max(len(spans) for spans in tree.attention_segments.prefixes) >= max(1, depth - 1)
    models = {}
    for name in ("padded", "prefix_tree"):
        models[name] = tiny_model(architecture).train()
        enable_segment_attention(models[name])
    for step in range(2):
        figures = {}
        for name, batch in (("padded", padded), ("prefix_tree", tree)):
            model = models[name]
            model.zero_grad()
            loss, metrics = loss_and_metrics(model, batch, advantages)
            loss.backward()
            figures[name] = (loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters()})
        (loss, metrics, grads), (tree_loss, tree_metrics, tree_grads) = figures["padded"], figures["prefix_tree"]
        assert abs(float(loss)) > 1e-4 and metrics["clip_frac_low"] > 0  # figures worth comparing
        torch.testing.assert_close(tree_loss, loss, rtol=1e-5, atol=1e-7)
        assert tree_metrics.keys() == metrics.keys()
        for field, value in metrics.items():
            torch.testing.assert_close(tree_metrics[field], value, rtol=1e-5, atol=1e-7, msg=field)
        for name, grad in grads.items():
            torch.testing.assert_close(tree_grads[name], grad, rtol=1e-5, atol=1e-7,
                                       msg=f"{name}, step {step + 1}, depth {depth}")
        with torch.no_grad():
            for model in models.values():
                for parameter in model.parameters():
                    parameter -= 0.5 * parameter.grad
    assert not torch.equal(models["padded"].lm_head.weight, tiny_model(architecture).lm_head.weight)

