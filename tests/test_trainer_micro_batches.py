"""Micro-batches cut by a token budget: the packing, and a mini-batch's gradient, loss and
metrics that depend neither on the cut nor on the layout, padded or packed (tiny model,
float64, every loss type with HA-DW, one and two ranks as DeepSpeed combines them: the
mean of the ranks' summed gradients)."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hadw_kernels import LOSS_PRESETS  # noqa: E402
from trainer.config import Config  # noqa: E402
from trainer.loop import UpdateFigures, batch_advantages  # noqa: E402
from trainer.micro_batches import (  # noqa: E402
    by_prompt_count,
    loss_normalizer,
    pack_by_tokens,
    packed_tokens,
    padded_tokens,
    split_to_count,
)
from trainer.policy import (  # noqa: E402
    PackedBatch,
    SequenceBatch,
    attention_respects_packing,
    packing_pays,
    policy_loss,
    response_hidden_states,
)
from trainer.synthetic_task import VOCABULARY  # noqa: E402
from trainer.tiny_model import build_tiny_model, build_tokenizer  # noqa: E402


def test_packing_respects_the_budget_and_keeps_every_row():
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 9, (40,), generator=generator).tolist()
    responses = torch.randint(0, 30, (40,), generator=generator).tolist()
    for budget in (1, 20, 64, 150, 10_000):
        micro_batches, oversized = pack_by_tokens(range(40), prompts, responses, budget)
        assert sorted(row for micro in micro_batches for row in micro) == list(range(40))
        for micro in micro_batches:
            assert len(micro) == 1 or padded_tokens(micro, prompts, responses) <= budget
        assert oversized == [micro[0] for micro in micro_batches
                             if padded_tokens(micro, prompts, responses) > budget]
        for count in sorted({len(micro_batches), min(len(micro_batches) + 3, 40), 40}):
            split = split_to_count(micro_batches, count, prompts, responses)
            assert len(split) == count
            assert sorted(row for micro in split for row in micro) == list(range(40))
            assert all(len(m) == 1 or padded_tokens(m, prompts, responses) <= budget for m in split)
    # Sorting by length keeps padding small: far below packing in arrival order.
    micro_batches, _ = pack_by_tokens(range(40), prompts, responses, 150)
    padded = sum(padded_tokens(micro, prompts, responses) for micro in micro_batches)
    assert padded < 1.35 * sum(p + r for p, r in zip(prompts, responses))
    with pytest.raises(ValueError, match="cannot cut"):
        split_to_count([[0, 1]], 3, prompts, responses)
    with pytest.raises(ValueError, match="positive"):
        pack_by_tokens([0], prompts, responses, 0)
    assert by_prompt_count(list(range(6)), 4) == [[0, 1, 2, 3], [4, 5]]


def test_packed_budgets_count_real_tokens():
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 9, (40,), generator=generator).tolist()
    responses = torch.randint(0, 30, (40,), generator=generator).tolist()
    for budget in (1, 20, 64, 150, 10_000):
        micro_batches, oversized = pack_by_tokens(range(40), prompts, responses, budget, packed=True)
        assert sorted(row for micro in micro_batches for row in micro) == list(range(40))
        for micro in micro_batches:
            assert len(micro) == 1 or packed_tokens(micro, prompts, responses) <= budget
        assert oversized == [micro[0] for micro in micro_batches if packed_tokens(micro, prompts, responses) > budget]
        split = split_to_count(micro_batches, min(len(micro_batches) + 3, 40), prompts, responses, packed=True)
        assert all(len(m) == 1 or packed_tokens(m, prompts, responses) <= budget for m in split)
    # Without padding a budget holds more responses: fewer micro-batches for the same rows.
    padded, _ = pack_by_tokens(range(40), prompts, responses, 150)
    packed, _ = pack_by_tokens(range(40), prompts, responses, 150, packed=True)
    assert len(packed) < len(padded)
    assert sum(len(micro) for micro in packed) == 40


def test_packed_batch_layout():
    """Each sample's prompt then response in one row, positions restarting, the loss's
    mask on the positions that predict a response token."""
    batch = PackedBatch.build([[5, 6], [7]], [[8, 9, 10], []], None, torch.device("cpu"))
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 10, 7]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0]]
    assert batch.cu_seqlens.tolist() == [0, 5, 6]
    assert batch.labels.tolist() == [[-100, 8, 9, 10, -100, -100]]
    assert batch.response_mask.tolist() == [[False, True, True, True, False, False]]
    values = torch.arange(6.0)[None]
    assert [v.tolist() for v in batch.per_response(values)] == [[1.0, 2.0, 3.0], []]
    assert batch.from_responses(batch.per_response(values)).tolist() == [[0.0, 1.0, 2.0, 3.0, 0.0, 0.0]]
    assert batch.model_inputs()["attention_mask"] is None


def test_the_tiny_model_confines_attention_to_each_sample():
    """The check that turns packing on (train.packing=null): the tiny model's sdpa
    attention confines itself to each sample of a packed row; with the same row read as
    one sequence (positions not restarting) the second sample sees the first."""
    config = Config()
    model = build_tiny_model(config.model, build_tokenizer(VOCABULARY), seed=0)
    assert model.config._attn_implementation == "sdpa"
    assert attention_respects_packing(model)
    ignoring = torch.nn.Module()
    ignoring.inner = model
    ignoring.get_input_embeddings = model.get_input_embeddings
    ignoring.forward = lambda position_ids, **kwargs: model(
        position_ids=torch.arange(position_ids.shape[1])[None], **kwargs)
    assert not attention_respects_packing(ignoring)


@pytest.mark.parametrize("attention, pays", [
    ("sdpa", False), ("eager", False), ("flash_attention_2", True), ("flash_attention_3", True),
])
def test_packing_is_the_default_only_with_flash_attention(attention, pays):
    """sdpa and eager attention mask a packed row densely (its length squared), which cost
    more than the padding on the CPU default and on a GPU (docs/trainer.md, "Packed
    micro-batches")."""
    model = torch.nn.Module()
    model.config = type("Config", (), {"_attn_implementation": attention})()
    assert packing_pays(model) is pays

GROUP = 4
PROMPTS = 4


def _setup(loss_type):
    config = Config()
    config.algorithm.loss_type = loss_type
    config.algorithm.loss_backend = "torch"
    config.rollout.group_size = GROUP
    config.rollout.max_new_tokens = 9
    tokenizer = build_tokenizer(VOCABULARY)
    model = build_tiny_model(config.model, tokenizer, seed=3).double()
    generator = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)
    prompts = [torch.randint(4, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 6, (PROMPTS,), generator=generator)]
    responses = [torch.randint(4, vocab, (int(n),), generator=generator).tolist()
                 for n in torch.randint(0, 10, (PROMPTS * GROUP,), generator=generator)]
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 0.5, 0.25, 1, 0], dtype=torch.float64)
    row_prompts = [prompts[row // GROUP] for row in range(PROMPTS * GROUP)]
    return config, model, tokenizer, row_prompts, responses, rewards


def _summed_gradient(config, model, tokenizer, row_prompts, responses, rewards, budget, world_size, packed=False):
    """The mini-batch's gradient as the trainer forms it: advantages once, each rank's rows
    packed under ``budget`` (as many micro-batches on every rank), each micro-batch's
    loss with the shared normaliser, the ranks' summed gradients averaged; and the
    logged figures, combined as the trainer combines them (``UpdateFigures``). ``packed``:
    each micro-batch one padding-free row (the trainer's train.packing)."""
    lambda_scale = 1.3
    advantages, _ = batch_advantages(rewards, GROUP, config.algorithm, lambda_scale, belief=0.4)
    prompt_lengths = [len(p) for p in row_prompts]
    response_lengths = [len(r) for r in responses]
    rows_per_rank = len(responses) // world_size
    rank_rows = [list(range(rank * rows_per_rank, (rank + 1) * rows_per_rank)) for rank in range(world_size)]
    plans = [pack_by_tokens(rows, prompt_lengths, response_lengths, budget, packed=packed)[0] for rows in rank_rows]
    count = max(len(plan) for plan in plans)
    plans = [split_to_count(plan, count, prompt_lengths, response_lengths, packed=packed) for plan in plans]
    layout = PackedBatch if packed else SequenceBatch
    normalizer = loss_normalizer(LOSS_PRESETS[config.algorithm.loss_type].loss_agg_mode,
                                 batch_tokens=sum(response_lengths), mini_batches=1,
                                 responses_per_rank=rows_per_rank, world_size=world_size)
    model.zero_grad()
    micro_batches = 0
    figures = UpdateFigures(LOSS_PRESETS[config.algorithm.loss_type].sequence_level)
    for plan in plans:
        for rows in plan:
            batch = layout.build([row_prompts[r] for r in rows], [responses[r] for r in rows],
                                 tokenizer.pad_token_id, torch.device("cpu"))
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


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_a_mini_batch_gradient_does_not_depend_on_the_cut(loss_type):
    """Padded and packed micro-batches, any budget, one or two ranks: the gradient of the
    whole padded mini-batch."""
    setup = _setup(loss_type)
    whole, count, whole_figures = _summed_gradient(*setup, budget=10**6, world_size=1)
    assert count == 1
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-4  # a gradient to compare
    # Figures to compare: a loss, clipping, a KL away from 0.
    assert abs(whole_figures["loss"]) > 1e-3 and whole_figures["approx_kl"] > 1e-3
    assert whole_figures["clip_frac_low"] > 0
    for packed in (False, True):
        for world_size in (1, 2):
            for budget in (1, 30, 60, 10**6):
                cut, count, figures = _summed_gradient(*setup, budget=budget, world_size=world_size, packed=packed)
                if budget == 1:
                    assert count == PROMPTS * GROUP  # one response per micro-batch
                assert cut.keys() == whole.keys()
                for name in whole:
                    torch.testing.assert_close(cut[name], whole[name], rtol=1e-9, atol=1e-12,
                                               msg=f"{name}, budget {budget}, {world_size} rank(s), packed {packed}")
                # The logged loss and metrics too: the loss's shares add up, each metric is
                # weighed by its count (averaged over micro-batches, the loss was 16x smaller
                # at one response a micro-batch). The metrics are float32.
                assert figures.keys() == whole_figures.keys()
                for name in whole_figures:
                    assert figures[name] == pytest.approx(whole_figures[name], rel=1e-6, abs=1e-9), \
                        (name, budget, world_size, packed)
