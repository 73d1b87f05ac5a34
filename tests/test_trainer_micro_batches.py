"""Micro-batches cut by a token budget: the packing, and a mini-batch's gradient, loss and
metrics that depend neither on the cut nor on the layout, padded, packed or with shared
prompts (tiny model, float64, every loss type with HA-DW, one and two ranks as DeepSpeed
combines them: the mean of the ranks' summed gradients)."""

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

from hadw_kernels import LOSS_PRESETS
from hadw_kernels.layouts import LAYOUTS, RowTokens, choose_layout, enable_segment_attention
from trainer.config import Config
from trainer.engine.loop import UpdateFigures, batch_advantages
from trainer.engine.micro_batches import by_prompt_count, loss_normalizer, pack_by_tokens, split_to_count
from trainer.engine.policy import policy_loss, response_hidden_states
from trainer.models.tiny_model import build_tiny_model, build_tokenizer
from trainer.tasks.synthetic_task import VOCABULARY


def rows_of_lengths(prompt_lengths, response_lengths, groups=None):
    """Rows of these lengths whose prompts are equal where ``groups`` says (else distinct),
    responses all distinct."""
    groups = range(len(prompt_lengths)) if groups is None else groups
    prompts = [[1000 + group] * length for group, length in zip(groups, prompt_lengths)]
    responses = [[2000 + row] * length for row, length in enumerate(response_lengths)]
    return RowTokens(prompts, responses)


def padded_tokens(rows, batch):
    return LAYOUTS["padded"].fed_tokens(batch, rows)


def test_packing_respects_the_budget_and_keeps_every_row():
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 9, (40,), generator=generator).tolist()
    responses = torch.randint(0, 30, (40,), generator=generator).tolist()
    batch = rows_of_lengths(prompts, responses)
    for budget in (1, 20, 64, 150, 10_000):
        micro_batches, oversized = pack_by_tokens(range(40), batch, budget)
        assert sorted(row for micro in micro_batches for row in micro) == list(range(40))
        for micro in micro_batches:
            assert len(micro) == 1 or padded_tokens(micro, batch) <= budget
        assert oversized == [micro[0] for micro in micro_batches if padded_tokens(micro, batch) > budget]
        for count in sorted({len(micro_batches), min(len(micro_batches) + 3, 40), 40}):
            split = split_to_count(micro_batches, count, batch)
            assert len(split) == count
            assert sorted(row for micro in split for row in micro) == list(range(40))
            assert all(len(m) == 1 or padded_tokens(m, batch) <= budget for m in split)
    # Sorting by length keeps padding small: far below packing in arrival order.
    micro_batches, _ = pack_by_tokens(range(40), batch, 150)
    padded = sum(padded_tokens(micro, batch) for micro in micro_batches)
    assert padded < 1.35 * sum(p + r for p, r in zip(prompts, responses))
    with pytest.raises(ValueError, match="cannot cut"):
        split_to_count([[0, 1]], 3, batch)
    with pytest.raises(ValueError, match="positive"):
        pack_by_tokens([0], batch, 0)
    assert by_prompt_count(list(range(6)), 4) == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("layout", ["packed", "shared_prompt", "prefix_tree"])
def test_packed_budgets_count_real_tokens(layout):
    """Budgets count the tokens through the model: every prompt and response token packed;
    each group's prompt once (but its last token) with shared prompts; each shared run
    once in the prefix tree."""
    generator = torch.Generator().manual_seed(1)
    group = 4
    prompts = [n for n in torch.randint(3, 9, (10,), generator=generator).tolist() for _ in range(group)]
    responses = torch.randint(0, 30, (40,), generator=generator).tolist()

    batch = rows_of_lengths(prompts, responses, [row // group for row in range(40)])
    layout = LAYOUTS[layout]

    def tokens(rows):
        return layout.fed_tokens(batch, rows)

    for budget in (1, 20, 64, 150, 10_000):
        micro_batches, oversized = pack_by_tokens(range(40), batch, budget, layout=layout)
        assert sorted(row for micro in micro_batches for row in micro) == list(range(40))
        for micro in micro_batches:
            assert len(micro) == 1 or tokens(micro) <= budget
        assert oversized == [micro[0] for micro in micro_batches if tokens(micro) > budget]
        split = split_to_count(micro_batches, min(len(micro_batches) + 3, 40), batch, layout=layout)
        assert all(len(m) == 1 or tokens(m) <= budget for m in split)
        if layout.shares_prompts:
            # A group stays in one micro-batch wherever it fits one.
            for first in range(0, 40, group):
                members = list(range(first, first + group))
                holding = [micro for micro in micro_batches if set(micro) & set(members)]
                assert len(holding) == 1 or tokens(members) > budget, (budget, first)
    # Without padding a budget holds more responses: fewer micro-batches for the same rows.
    padded, _ = pack_by_tokens(range(40), batch, 150)
    packed, _ = pack_by_tokens(range(40), batch, 150, layout=layout)
    assert len(packed) < len(padded)
    assert sum(len(micro) for micro in packed) == 40


def test_a_group_larger_than_the_budget_is_split_with_its_prompt_in_each_part():
    batch = rows_of_lengths([10] * 4, [6, 6, 6, 6], [0] * 4)
    layout = LAYOUTS["shared_prompt"]
    micro_batches, oversized = pack_by_tokens(range(4), batch, 25, layout=layout)
    assert micro_batches == [[0, 1], [2, 3]] and oversized == []
    for micro in micro_batches:
        built = layout.build_rows(batch.subset(micro))
        assert built.fed_tokens == layout.fed_tokens(batch, micro) == 21


def test_a_shared_prompt_plan_keeps_groups_found_by_their_prompt_tokens():
    """Rows of one prompt need not be contiguous (a shuffled batch): the plan keeps each
    prompt's rows together where they fit, as it does for contiguous groups."""
    batch = rows_of_lengths([6, 3, 6, 3, 6, 3], [2, 2, 2, 2, 2, 2], [0, 1, 0, 1, 0, 1])
    for layout in ("shared_prompt", "prefix_tree"):
        micro_batches, _ = pack_by_tokens(range(6), batch, 12, layout=LAYOUTS[layout])
        assert sorted(map(sorted, micro_batches)) == [[0, 2, 4], [1, 3, 5]], layout


def test_a_prefix_tree_plan_keeps_rows_that_share_runs_together():
    """Prompts that begin with a common system prompt and differ after it, interleaved
    with prompts sharing nothing: the plan packs the rows in token order, so a budget
    holding two groups holds two that share the system prompt."""
    system = list(range(100, 120))
    prompts = [system + [1], [7, 7], system + [2], [8, 8]] * 2
    responses = [[50 + row, 3] for row in range(8)]
    batch = RowTokens(prompts, responses)
    layout = LAYOUTS["prefix_tree"]
    budget = layout.fed_tokens(batch, [0, 2, 4, 6])
    micro_batches, _ = pack_by_tokens(range(8), batch, budget, layout=layout)
    assert sorted(map(sorted, micro_batches)) == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("option, layout", [
    ("auto", "prefix_tree"), ("padded", "padded"), ("packed", "packed"), ("shared_prompt", "shared_prompt"),
    ("prefix_tree", "prefix_tree"),
])
def test_the_layout_follows_the_option(option, layout):
    model = build_tiny_model(Config().model, build_tokenizer(VOCABULARY), seed=0)
    chosen, why, fallback = choose_layout([model], option, option="train.layout")
    assert chosen.name == layout and fallback is None, why
    expected_attention = "sdpa" if layout == "padded" else "hadw_segments_over_sdpa"
    assert model.config._attn_implementation == expected_attention


@pytest.mark.parametrize("option", ["packed", "shared_prompt", "prefix_tree"])
def test_a_layout_the_model_cannot_serve_is_refused_naming_the_option(option):
    """Sliding-window attention: the segment attention does not serve it, so a packed row
    could not be confined; auto falls back to padding (saying why), a packed layout named
    is refused at startup."""
    config = Config()
    config.model.architecture = "qwen2"
    model = build_tiny_model(config.model, build_tokenizer(VOCABULARY), seed=0)
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    chosen, _, fallback = choose_layout([model], "auto", option="train.layout")
    assert chosen.name == "padded" and "sliding-window" in fallback
    with pytest.raises(ValueError, match=f"train.layout='{option}'"):
        choose_layout([model], option, option="train.layout")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="unknown train.layout 'tree'"):
        choose_layout([model], "tree", option="train.layout")


GROUP = 4
PROMPTS = 4


def _norms_in_float64(model):
    """transformers' RMSNorm rounds its input to float32 (and so, in backward, the gradient
    through it): a prompt token laid out once sums its responses' gradients before that
    rounding, G rows of it after, which differ by float32 rounding (1e-7). The layouts
    are compared in float64 throughout, so the norms keep the input's dtype here."""

    def forward(norm, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return norm.weight * (hidden_states * torch.rsqrt(variance + norm.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = forward.__get__(module)
    return model


def _setup(loss_type, architecture="llama"):
    config = Config()
    config.model.architecture = architecture
    config.algorithm.loss_type = loss_type
    config.algorithm.loss_backend = "torch"
    config.rollout.group_size = GROUP
    config.rollout.max_new_tokens = 9
    tokenizer = build_tokenizer(VOCABULARY)
    model = _norms_in_float64(build_tiny_model(config.model, tokenizer, seed=3).double())
    enable_segment_attention(model)  # padded rows still go to sdpa through it
    generator = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)
    prompts = [torch.randint(4, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 6, (PROMPTS,), generator=generator)]
    responses = [torch.randint(4, vocab, (int(n),), generator=generator).tolist()
                 for n in torch.randint(0, 10, (PROMPTS * GROUP,), generator=generator)]
    # Responses of one token and of the longest length; a group whose responses are all empty.
    responses[0], responses[1] = responses[1][:1], [5] * config.rollout.max_new_tokens
    responses[2 * GROUP:3 * GROUP] = [[] for _ in range(GROUP)]
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 0.5, 0.25, 1, 0], dtype=torch.float64)
    row_prompts = [prompts[row // GROUP] for row in range(PROMPTS * GROUP)]
    return config, model, tokenizer, row_prompts, responses, rewards


def _summed_gradient(config, model, tokenizer, row_prompts, responses, rewards, budget, world_size,
                     layout="padded"):
    """The mini-batch's gradient as the trainer forms it: advantages once, each rank's rows
    packed under ``budget`` (as many micro-batches on every rank), each micro-batch's
    loss with the shared normaliser, the ranks' summed gradients averaged; and the
    logged figures, combined as the trainer combines them (``UpdateFigures``), with the
    micro-batches in ``layout`` (``hadw_kernels.layouts.LAYOUTS``)."""
    lambda_scale = 1.3
    advantages, _ = batch_advantages(rewards, GROUP, config.algorithm, lambda_scale, belief=0.4)
    rows_tokens = RowTokens(row_prompts, responses)
    rows_per_rank = len(responses) // world_size
    rank_rows = [list(range(rank * rows_per_rank, (rank + 1) * rows_per_rank)) for rank in range(world_size)]
    layout = LAYOUTS[layout]
    plans = [pack_by_tokens(rows, rows_tokens, budget, layout=layout)[0] for rows in rank_rows]
    count = max(len(plan) for plan in plans)
    plans = [split_to_count(plan, count, rows_tokens, layout=layout) for plan in plans]
    normalizer = loss_normalizer(LOSS_PRESETS[config.algorithm.loss_type].loss_agg_mode,
                                 batch_tokens=sum(rows_tokens.response_lengths), mini_batches=1,
                                 responses_per_rank=rows_per_rank, world_size=world_size)
    model.zero_grad()
    micro_batches = 0
    figures = UpdateFigures(LOSS_PRESETS[config.algorithm.loss_type].sequence_level)
    for plan in plans:
        for rows in plan:
            batch = layout.build([row_prompts[r] for r in rows], [responses[r] for r in rows],
                                 pad_token_id=tokenizer.pad_token_id)
            hidden = response_hidden_states(model, batch)
            with torch.no_grad():
                old = hidden.new_zeros(batch.labels.shape)  # a ratio far from 1: clipping applies
                old.masked_fill_(batch.response_mask, -2.5)
            loss, metrics = policy_loss(hidden, model.get_output_embeddings().weight, batch, old,
                                        advantages[rows], config, loss_normalizer=normalizer)
            (loss / world_size).backward()
            figures.add_micro_batch({"loss": float(loss.detach()), **{name: float(v) for name, v in metrics.items()}},
                                    batch.response_lengths)
            micro_batches += 1
    figures.end_mini_batch()  # every rank's one mini-batch: the all-reduce's sums, formed here
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return gradients, micro_batches, figures.result(world_size)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_a_mini_batch_gradient_does_not_depend_on_the_cut(loss_type, architecture):
    """Padded, packed and shared-prompt micro-batches, any budget, one or two ranks: the
    gradient of the whole padded mini-batch."""
    setup = _setup(loss_type, architecture)
    whole, count, whole_figures = _summed_gradient(*setup, budget=10**6, world_size=1)
    assert count == 1
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-4  # a gradient to compare
    # Figures to compare: a loss, clipping, a KL away from 0.
    assert abs(whole_figures["loss"]) > 1e-3 and whole_figures["approx_kl"] > 1e-3
    assert whole_figures["clip_frac_low"] > 0
    for layout in LAYOUTS:
        for world_size in (1, 2):
            for budget in (1, 30, 60, 10**6):
                cut, count, figures = _summed_gradient(*setup, budget=budget, world_size=world_size, layout=layout)
                if budget == 1:
                    assert count == PROMPTS * GROUP  # one response per micro-batch
                assert cut.keys() == whole.keys()
                for name in whole:
                    torch.testing.assert_close(cut[name], whole[name], rtol=1e-9, atol=1e-12,
                                               msg=f"{name}, budget {budget}, {world_size} rank(s), {layout}")
                # The logged loss and metrics too: the loss's shares add up, each metric is
                # weighed by its count (averaged over micro-batches, the loss was 16x smaller
                # at one response a micro-batch). The metrics are float32.
                assert figures.keys() == whole_figures.keys()
                for name in whole_figures:
                    assert figures[name] == pytest.approx(whole_figures[name], rel=1e-6, abs=1e-9), \
                        (name, budget, world_size, layout)
