"""The model-side layouts (hadw_kernels/layouts/): what each builds from prompt and
response tokens, what it counts, which rows share a prompt, and the segment attention on
tiny Llama and Qwen2 models: each response position gets the hidden state it gets alone,
and no sample's tokens reach another's, in rows of any order."""

import random
import re

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hadw_kernels.layouts import (
    LAYOUTS,
    RowTokens,
    SegmentAttentionUnavailable,
    disable_segment_attention,
    enable_segment_attention,
    get_layout,
    prompt_groups,
    rows_by_group,
)
from hadw_kernels.layouts.switch import keeps_samples_apart

VOCAB = 40


# Tiny random models of each architecture transformers ships that a trainer may bring,
# built from a config (no download): (config class, model class, the config's own fields).
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(head_dim=8)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(head_dim=8)),
    "phi": (PhiConfig, PhiForCausalLM, {}),
}


def tiny_model(architecture: str = "llama", seed: int = 0, **fields):
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    config_class, model_class, own = ARCHITECTURES[architecture]
    config = config_class(**shape, **{**own, **fields})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    return model.eval()


def hidden_states(model, batch) -> torch.Tensor:
    with torch.no_grad():
        outputs = model(**batch.model_inputs(model), use_cache=False, output_hidden_states=True)
    return batch.loss_hidden_states(outputs.hidden_states[-1])


def test_rows_share_a_prompt_by_its_tokens_not_their_order():
    prompts = [[1, 2], [3], [1, 2], [1], [3]]
    assert prompt_groups(prompts) == [0, 1, 0, 2, 1]
    assert rows_by_group(prompt_groups(prompts)) == [[0, 2], [1, 4], [3]]


def test_packed_layout():
    """Each sample's prompt then response in one row, positions restarting, the loss's
    mask on the positions that predict a response token."""
    batch = LAYOUTS["packed"].build([[5, 6], [7]], [[8, 9, 10], []])
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 10, 7]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0]]
    assert batch.cu_seqlens.tolist() == [0, 5, 6]
    assert batch.labels.tolist() == [[-100, 8, 9, 10, -100, -100]]
    assert batch.response_mask.tolist() == [[False, True, True, True, False, False]]
    values = torch.arange(6.0)[None]
    assert [v.tolist() for v in batch.per_response(values)] == [[1.0, 2.0, 3.0], []]
    assert batch.from_responses(batch.per_response(values)).tolist() == [[0.0, 1.0, 2.0, 3.0, 0.0, 0.0]]
    served = tiny_model()
    enable_segment_attention(served)
    assert batch.model_inputs(served)["attention_mask"] is None
    assert batch.fed_tokens == 6 and batch.segment_rows is None


def test_shared_prompt_layout():
    """A group's prompt once but its last token (the trunk, predicting nothing), then each
    response's branch: the prompt's last token and the response but its last token, at
    positions from P - 1, each position predicting the response token at its index; the
    loss's segments one a response, the first holding the trunk; the attention's segments
    the trunk and each branch reading the trunk first."""
    batch = LAYOUTS["shared_prompt"].build([[5, 6, 7], [5, 6, 7], [8]], [[9, 10], [11], [12, 13]])
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 7, 8, 12]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1]]
    assert batch.labels.tolist() == [[-100, -100, 9, 10, 11, 12, 13]]
    assert batch.cu_seqlens.tolist() == [0, 4, 5, 7]
    assert batch.response_starts == [2, 4, 5] and batch.response_lengths == [2, 1, 2]
    segments = batch.attention_segments
    assert list(zip(segments.starts, segments.lengths, segments.prefixes)) == [
        (0, 2, ()), (2, 2, ((0, 2),)), (4, 1, ((0, 2),)), (5, 2, ())]
    values = torch.arange(7.0)[None]
    assert [v.tolist() for v in batch.per_response(values)] == [[2.0, 3.0], [4.0], [5.0, 6.0]]
    assert batch.from_responses(batch.per_response(values)).tolist() == [[0, 0, 2, 3, 4, 5, 6]]
    # A group whose responses are all empty lays out its whole prompt: never an empty row.
    empty = LAYOUTS["shared_prompt"].build([[5, 6]] * 2, [[], []])
    assert empty.input_ids.tolist() == [[5, 6]] and empty.response_mask.sum() == 0
    assert empty.cu_seqlens.tolist() == [0, 2, 2]


def test_a_shuffled_batch_lays_each_prompt_out_once():
    """Rows of two prompts interleaved (as TRL's shuffled micro-batches hold them): each
    prompt is laid out once, the loss's segments grouped by prompt, and the per-row and
    per-token maps put every value back on its row."""
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]]
    responses = [[10, 11], [12], [13], [14, 15, 16]]
    batch = LAYOUTS["shared_prompt"].build(prompts, responses)
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 7, 8, 9, 9, 14, 15]]
    assert batch.segment_rows == [0, 2, 1, 3]
    assert batch.per_segment(torch.tensor([0.0, 1.0, 2.0, 3.0])).tolist() == [0.0, 2.0, 1.0, 3.0]
    assert batch.fed_tokens == LAYOUTS["shared_prompt"].fed_tokens(RowTokens(prompts, responses)) == 10
    padded = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 0.0, 0.0], [5.0, 6.0, 7.0]])
    laid_out = batch.from_padded(padded, fill=-1.0)
    assert laid_out.tolist() == [[-1, -1, 1, 2, 4, -1, 3, 5, 6, 7]]
    assert [v.tolist() for v in batch.per_response(laid_out)] == [[1, 2], [3], [4], [5, 6, 7]]
    assert torch.equal(batch.to_padded(laid_out, 3), padded)
    # Labels and mask agree with the tokens each position predicts.
    assert batch.labels[batch.response_mask].tolist() == [10, 11, 13, 12, 14, 15, 16]


def test_the_padded_layout_maps_its_rows_the_same_way():
    batch = LAYOUTS["padded"].build([[5, 6], [7]], [[8, 9, 10], []], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 10], [0, 7, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert batch.fed_tokens == LAYOUTS["padded"].fed_tokens(RowTokens([[5, 6], [7]], [[8, 9, 10], []])) == 10
    padded = torch.tensor([[1.0, 2.0, 3.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    assert batch.from_padded(padded).tolist() == [[1, 2, 3], [0, 0, 0]]
    assert batch.to_padded(batch.from_padded(padded), 4).tolist() == [[1, 2, 3, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="needs a pad_token_id"):
        LAYOUTS["padded"].build([[5]], [[6]])


def test_token_counts():
    """A group's prompt counts once, but its last token (it starts every response's
    branch); whole where the group's responses here are all empty. The prefix tree counts
    each shared run once and no row's last token: a prompt's tokens once, then each
    response's but its last."""
    prompts = [[1, 2, 3, 4, 5]] * 3 + [[6, 7, 8]] * 3
    responses = [[9, 9, 9, 9], [], [9, 8], [], [], []]
    distinct = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7], [7, 8, 9], [7, 8, 10], [7, 8, 11]]
    batch, unshared = RowTokens(prompts, responses), RowTokens(distinct, responses)
    shared, packed, tree = LAYOUTS["shared_prompt"], LAYOUTS["packed"], LAYOUTS["prefix_tree"]
    assert shared.fed_tokens(batch, [0, 1, 2]) == 4 + 6
    assert shared.fed_tokens(batch, [1]) == 5
    assert shared.fed_tokens(batch, [3, 4, 5]) == 3
    assert shared.fed_tokens(batch) == 4 + 6 + 3
    assert shared.fed_tokens(unshared) == (4 + 4) + 5 + (4 + 2) + 3 + 3 + 3
    assert packed.fed_tokens(batch) == 24 + 6
    # [1, 2, 3, 4, 5, 9, 9, 9] and [.., 5, 9] share [1, 2, 3, 4, 5, 9]; the empty response
    # reads nothing beyond its prompt.
    assert tree.fed_tokens(batch, [0, 1, 2]) == 8 and tree.fed_tokens(batch) == 8 + 3
    # [1, 2, 3, 4, 5, 9, 9, 9], [1, 2, 3, 4, 6] and [1, 2, 3, 4, 7, 9] share four tokens;
    # [7, 8, 9], [7, 8, 10] and [7, 8, 11] two.
    assert tree.fed_tokens(unshared) == 8 + 1 + 2 + 3 + 1 + 1
    with pytest.raises(ValueError, match="unknown layout 'ragged'"):
        get_layout("ragged")


def random_forked_rows(seed: int, rows: int = 12):
    """Rows that share runs at several depths: a system prompt most prompts begin with,
    prompts repeated, responses that begin alike, a row that is a prefix of another, an
    empty response and a row sharing nothing."""
    generator = random.Random(seed)

    def tokens(count):
        return [generator.randrange(3, VOCAB) for _ in range(count)]

    system = tokens(5)
    questions = [system + tokens(generator.randrange(1, 4)) for _ in range(3)] + [tokens(2)]
    prompts, responses = [], []
    for _ in range(rows):
        prompt = generator.choice(questions)
        earlier = [response for other, response in zip(prompts, responses) if other == prompt and response]
        if earlier and generator.random() < 0.6:  # a fork of an earlier response, or a prefix of it
            base = generator.choice(earlier)
            keep = generator.randrange(0, len(base) + 1)
            response = base[:keep] + (tokens(generator.randrange(0, 4)) if generator.random() < 0.7 else [])
        else:
            response = tokens(generator.randrange(0, 6))
        prompts.append(prompt)
        responses.append(response)
    return prompts, responses


@pytest.mark.parametrize("seed", range(6))
def test_every_tally_counts_what_its_layout_builds(seed):
    """A tally grown row by row and asked of any subset counts the tokens the layout's
    build feeds, and the prefix tree feeds no more than any other layout (what lets
    ``auto`` take it)."""
    prompts, responses = random_forked_rows(seed)
    batch = RowTokens(prompts, responses)
    order = random.Random(seed).sample(range(len(prompts)), len(prompts))
    fed = {}
    for name, layout in LAYOUTS.items():
        tally = layout.tally(batch)
        for count, row in enumerate(order, start=1):
            joined = order[:count]
            built = layout.build([prompts[r] for r in joined], [responses[r] for r in joined], pad_token_id=0)
            assert tally.with_rows([row]) == built.fed_tokens, (name, count)
            tally.add([row])
            assert tally.with_rows([]) == built.fed_tokens == layout.fed_tokens(batch, joined)
        fed[name] = tally.with_rows([])
    assert fed["prefix_tree"] == min(fed.values())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_subset_of_checked_rows_builds_what_its_rows_build(name):
    """A trainer checks its rollout batch once and builds each micro-batch from a subset
    of it: the same batch as building those rows' tokens, shuffled rows and a group's
    prompt ids from the whole batch included."""
    prompts, responses = random_forked_rows(3)
    rows = [7, 2, 9, 0, 4]
    laid_out = LAYOUTS[name].build_rows(RowTokens(prompts, responses).subset(rows), pad_token_id=0)
    expected = LAYOUTS[name].build([prompts[r] for r in rows], [responses[r] for r in rows], pad_token_id=0)
    for field in ("input_ids", "position_ids", "attention_mask", "labels", "response_mask", "cu_seqlens",
                  "hidden_index"):
        mine, theirs = getattr(laid_out, field), getattr(expected, field)
        assert (mine is None and theirs is None) or torch.equal(mine, theirs), field
    assert laid_out.attention_segments == expected.attention_segments
    assert (laid_out.response_starts, laid_out.segment_rows) == (expected.response_starts, expected.segment_rows)
    with pytest.raises(TypeError, match="build_rows takes a RowTokens"):
        LAYOUTS[name].build_rows([prompts, responses])


def test_prefix_tree_layout():
    """Rows sorted by their fed sequences (prompt and response but its last token), each
    after its longest common prefix with the one before: a prompt shared by three rows,
    two responses that begin alike, a row that is a prefix of another's, an empty response
    (nothing read) and a row sharing nothing. Each response's loss positions gather the
    hidden states that predict it."""
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [9]]
    responses = [[7, 8, 9], [7, 8, 6], [5, 5], [], [3]]
    batch = LAYOUTS["prefix_tree"].build(prompts, responses)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 7, 8, 5, 5, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 0]]
    segments = batch.attention_segments
    assert list(zip(segments.starts, segments.lengths, segments.prefixes)) == [
        (0, 4, ()), (4, 2, ((0, 4),)), (6, 2, ((0, 2),)), (8, 1, ())]
    assert batch.segment_rows == [3, 0, 1, 2, 4]
    assert batch.labels.tolist() == [[7, 8, 9, 7, 8, 6, 5, 5, 3]] and bool(batch.response_mask.all())
    assert batch.cu_seqlens.tolist() == [0, 0, 3, 6, 8, 9]
    assert batch.hidden_index.tolist() == [3, 4, 5, 3, 4, 5, 6, 7, 8]
    assert batch.response_starts == [0, 3, 6, 0, 8]
    hidden = torch.arange(9.0)[None, :, None]
    assert batch.loss_hidden_states(hidden).flatten().tolist() == [3, 4, 5, 3, 4, 5, 6, 7, 8]
    assert batch.per_segment(torch.arange(5)).tolist() == [3, 0, 1, 2, 4]
    values = torch.arange(9.0)[None]
    assert [v.tolist() for v in batch.per_response(values)] == [[0, 1, 2], [3, 4, 5], [6, 7], [], [8]]
    # Every response empty: the prompts laid out whole, the loss's layout empty.
    empty = LAYOUTS["prefix_tree"].build([[5, 6], [5, 6, 7]], [[], []])
    assert empty.input_ids.tolist() == [[5, 6, 7]] and empty.labels.shape == (1, 0)


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="2 prompts for 1 responses"):
        LAYOUTS["packed"].build([[1], [2]], [[3]])
    with pytest.raises(ValueError, match="needs a prompt token"):
        LAYOUTS["shared_prompt"].build([[]], [[3]])
    with pytest.raises(ValueError, match="at least one row"):
        LAYOUTS["packed"].build([], [])


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_each_response_gets_its_own_hidden_states_in_every_layout(architecture):
    """Rows in a shuffled order, two sharing a prompt apart from each other, an empty
    response and a one-token prompt: each response position's hidden state is the one it
    has alone, in every layout."""
    model = tiny_model(architecture)
    enable_segment_attention(model)
    assert model.config._attn_implementation == "hadw_segments_over_sdpa"
    generator = torch.Generator().manual_seed(1)

    def tokens(count):
        return torch.randint(0, VOCAB, (count,), generator=generator).tolist()

    shared, other = tokens(4), tokens(3)
    prompts = [shared, other, [7], shared, other, shared]
    responses = [tokens(3), tokens(5), tokens(2), [], tokens(1), tokens(4)]
    alone = [hidden_states(model, LAYOUTS["padded"].build([p], [r], pad_token_id=0))[0, :len(r)]
             for p, r in zip(prompts, responses)]
    for layout in LAYOUTS.values():
        batch = layout.build(prompts, responses, pad_token_id=0)
        flat = hidden_states(model, batch).reshape(-1, 32)
        for row, (start, length) in enumerate(zip(batch.response_starts, batch.response_lengths)):
            torch.testing.assert_close(flat[start:start + length], alone[row], rtol=1e-5, atol=1e-5,
                                       msg=f"{layout.name}, row {row}")


@pytest.mark.parametrize("layout", ["packed", "shared_prompt", "prefix_tree"])
def test_no_token_attends_across_samples(layout):
    """Changing one sample's response tokens changes no other sample's hidden states,
    bit for bit (responses of one prompt included: a branch reads the prompt, never a
    sibling's branch); changing a shared prompt changes only its own responses'."""
    model = tiny_model()
    enable_segment_attention(model)
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3], [6]]
    responses = [[7, 8, 9], [10, 11], [12, 13, 14, 15], [16, 17]]
    built = LAYOUTS[layout]
    before = built.build(prompts, responses)
    base = before.per_response(hidden_states(model, before).sum(-1))
    for changed in range(4):
        altered = [list(r) for r in responses]
        altered[changed] = [(token + 17) % VOCAB for token in altered[changed]]
        after = built.build(prompts, altered)
        values = after.per_response(hidden_states(model, after).sum(-1))
        for row in range(4):
            if row == changed:
                # Its first position reads the prompt only: the rest see its own new tokens.
                assert not torch.equal(values[row][1:], base[row][1:])
            else:
                assert torch.equal(values[row], base[row]), (layout, changed, row)
    moved = [[1, 2, 30], [4, 5], [1, 2, 30], [6]]
    after = built.build(moved, responses)
    values = after.per_response(hidden_states(model, after).sum(-1))
    assert torch.equal(values[1], base[1]) and torch.equal(values[3], base[3])
    assert not torch.equal(values[0], base[0]) and not torch.equal(values[2], base[2])


@pytest.mark.parametrize("use_cache", [False, True, "default"])
def test_a_packed_row_without_its_segments_is_refused(use_cache):
    """Nothing attends across samples silently: a packed row (positions restarting) that
    reaches the segment attention without its segments is an error, whether the forward
    keeps a cache (transformers' own packed-row detection then does not run) or not."""
    model = tiny_model()
    enable_segment_attention(model)
    batch = LAYOUTS["packed"].build([[5, 6], [7]], [[8, 9, 10], [11]])
    inputs = {**batch.model_inputs(model), "attention_segments": None}
    cache = {} if use_cache == "default" else {"use_cache": use_cache}
    with pytest.raises(ValueError, match="without its segments"):
        model(**inputs, **cache)
    # A padded batch and generation still go to the model's own attention.
    padded = LAYOUTS["padded"].build([[5, 6], [7]], [[8, 9, 10], [11]], pad_token_id=0)
    assert model(**padded.model_inputs()).logits.shape == (2, 5, VOCAB)
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


def test_a_model_the_segment_attention_cannot_serve_is_refused_naming_its_attention():
    model = tiny_model("qwen2")
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    with pytest.raises(SegmentAttentionUnavailable, match=r"this model's attention \(sdpa\) has sliding-window"):
        enable_segment_attention(model)
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model()
    eager.set_attn_implementation("eager")  # the model's own function, not in transformers' AttentionInterface
    with pytest.raises(SegmentAttentionUnavailable, match=r"this model's attention \(eager\) is not one"):
        enable_segment_attention(eager)
    assert eager.config._attn_implementation == "eager"
    served = tiny_model()
    enable_segment_attention(served)
    enable_segment_attention(served)  # again: nothing changes
    assert served.config._attn_implementation == "hadw_segments_over_sdpa"
    disable_segment_attention(served)
    assert served.config._attn_implementation == "sdpa"


def test_the_startup_check_fails_a_model_that_attends_across_the_row():
    model = tiny_model()
    enable_segment_attention(model)
    assert keeps_samples_apart(model)
    across = torch.nn.Module()
    across.inner = model
    across.get_input_embeddings = model.get_input_embeddings
    across.forward = lambda position_ids, attention_segments=None, **kwargs: model(
        position_ids=torch.arange(position_ids.shape[1])[None], **kwargs)
    assert not keeps_samples_apart(across)


def test_importing_the_library_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, hadw_kernels, hadw_kernels.layouts; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- what a layout refuses: a trainer's inputs, checked before anything is built ----------


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("prompts", [[[], [5]], [[], []]])
def test_an_empty_prompt_is_refused_in_every_layout(name, prompts):
    """A response's first token is predicted from its prompt's last token: with none, the
    padded layout read it from a padding position (or, every prompt empty, returned no
    hidden states at all)."""
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty: a sample needs a prompt token"):
        LAYOUTS[name].build(prompts, [[6], [7]], pad_token_id=0)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(("prompts", "responses", "error", "message"), [
    ([[5]], [[6, -100]], ValueError, r"responses\[0\]\[1\] is -100: token ids are non-negative"),
    ([[5, -1]], [[6]], ValueError, r"prompts\[0\]\[1\] is -1: token ids are non-negative"),
    ([[5]], [[6, 1.5]], TypeError, r"responses\[0\]\[1\] is 1.5 \(float\): token ids are ints"),
    ([[5, True]], [[6]], TypeError, r"prompts\[0\]\[1\] is True \(bool\): token ids are ints"),
    ([[5]], [[None]], TypeError, r"responses\[0\]\[0\] is None \(NoneType\)"),
    ([[5]], ["ab"], TypeError, r"responses\[0\] is 'ab', not a sequence of token ids"),
    ([5, 6], [[7], [8]], TypeError, r"prompts\[0\] is 5, not a sequence of token ids"),
    ([[5]], [torch.tensor([[6, 7]])], TypeError, r"responses\[0\] is a 2-D tensor"),
    ([torch.tensor([5.0])], [[6]], TypeError, r"prompts\[0\] is a tensor of torch.float32"),
    (torch.tensor([[5, 6]]), [[7]], TypeError, r"prompts is a tensor: .* padding"),
    ([[5]], 7, TypeError, r"responses is 7, not a sequence of rows"),
])
def test_token_ids_a_trainer_might_hold_by_mistake_are_refused_naming_them(name, prompts, responses, error, message):
    """-100 in a response would become the labels' ignore value (the token dropped from
    the loss while response_lengths counts it); a float, a bool or None would be truncated
    or fail inside torch; a flat list or a string is not a list of rows; a tensor of rows
    holds padding a layout cannot tell from tokens."""
    with pytest.raises(error, match=message):
        LAYOUTS[name].build(prompts, responses, pad_token_id=0)


@pytest.mark.parametrize(("pad_token_id", "error"), [(-1, ValueError), (0.5, TypeError), (True, TypeError)])
def test_a_bad_pad_token_id_is_refused(pad_token_id, error):
    with pytest.raises(error, match="pad_token_id"):
        LAYOUTS["padded"].build([[5]], [[6]], pad_token_id=pad_token_id)


def test_tensor_rows_are_taken_as_the_lists_they_are():
    """Equal prompts given as 1-D tensors share their prompt, as lists do."""
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7]), torch.tensor([8])]
    responses = [torch.tensor([9, 10]), torch.tensor([11], dtype=torch.int32), [12]]
    batch = LAYOUTS["shared_prompt"].build(prompts, responses)
    assert batch.input_ids.tolist() == LAYOUTS["shared_prompt"].build(
        [[5, 6, 7], [5, 6, 7], [8]], [[9, 10], [11], [12]]).input_ids.tolist() == [[5, 6, 7, 9, 7, 8]]
    assert prompt_groups(prompts) == [0, 0, 1]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_maps_refuse_values_of_another_shape(name):
    """Each map between the rows and the loss's layout checks the shape it is given: a
    tensor one token short, a response longer than its row, too few or too many rows,
    were cut, padded with zeros, written into the next row's slots or returned as given."""
    batch = LAYOUTS[name].build([[5, 6, 7], [8], [5, 6, 7]], [[9, 10], [11, 12, 13], [14]], pad_token_id=0)
    shape = tuple(batch.labels.shape)
    short = torch.zeros(batch.labels.numel() - 1)
    with pytest.raises(ValueError, match=rf"values of shape \({short.numel()},\): the loss's layout is"):
        batch.per_response(short)
    with pytest.raises(ValueError, match="values of shape"):
        batch.to_padded(torch.zeros(2, *shape), 3)
    with pytest.raises(ValueError, match=r"width 2 is below the longest response \(3 tokens\)"):
        batch.to_padded(torch.zeros(shape), 2)
    with pytest.raises(ValueError, match=r"values of shape \(4, 3\): 3 rows"):
        batch.from_padded(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"values of shape \(2, 3\): 3 rows"):
        batch.from_padded(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"values of shape \(3, 2\): 3 rows, the longest response 3 tokens"):
        batch.from_padded(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"values of shape \(3,\): 3 rows"):
        batch.from_padded(torch.zeros(3))
    with pytest.raises(ValueError, match="2 responses' values for 3 rows"):
        batch.from_responses([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"per_response\[1\] of shape \(4,\): row 1's response has 3 tokens"):
        batch.from_responses([torch.zeros(2), torch.zeros(4), torch.zeros(1)])
    with pytest.raises(TypeError, match=r"per_response\[0\] must be a torch.Tensor, got list"):
        batch.from_responses([[0.0, 0.0], torch.zeros(3), torch.zeros(1)])
    for wrong in (torch.zeros(2), torch.zeros(4), torch.zeros(())):
        with pytest.raises(ValueError, match=rf"values of shape {re.escape(str(tuple(wrong.shape)))}: 3 rows"):
            batch.per_segment(wrong)
    with pytest.raises(TypeError, match="values must be a torch.Tensor, got list"):
        batch.per_segment([1.0, 2.0, 3.0])
    hidden = torch.zeros(*batch.input_ids.shape, 4)
    assert batch.loss_hidden_states(hidden).shape[:2] == batch.labels.shape
    for wrong in (hidden[:, 1:], hidden[..., 0], hidden[None]):
        with pytest.raises(ValueError, match=r"hidden_states of shape .*: the model was fed input_ids of shape"):
            batch.loss_hidden_states(wrong)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_from_responses_keeps_the_values_dtype(name):
    batch = LAYOUTS[name].build([[5, 6], [7]], [[8, 9], [10]], pad_token_id=0)
    values = [torch.tensor([0.1, 0.2], dtype=torch.float64), torch.tensor([0.3], dtype=torch.float64)]
    laid_out = batch.from_responses(values)
    assert laid_out.dtype == torch.float64 and laid_out.shape == batch.labels.shape
    assert [v.tolist() for v in batch.per_response(laid_out)] == [[0.1, 0.2], [0.3]]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_tally_refuses_rows_it_cannot_count(name):
    """A negative length was counted; a row beyond the lengths, or lists of other lengths,
    ended in an IndexError. A tally now counts the rows' tokens, checked once."""
    layout = LAYOUTS[name]
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty: a sample needs a prompt token"):
        RowTokens([[], [3]], [[2], [2]])
    with pytest.raises(ValueError, match="2 prompts for 3 responses"):
        RowTokens([[3], [3]], [[2], [2], [2]])
    with pytest.raises(ValueError, match=r"responses\[1\]\[0\] is -2"):
        RowTokens([[3], [3]], [[2], [-2]])
    with pytest.raises(TypeError, match="a tally counts a RowTokens"):
        layout.tally([[3, 3], [2, 2]])
    batch = RowTokens([[3, 4, 5], [3, 4, 5]], [[6, 7], [6, 8]])
    tally = layout.tally(batch)
    for row in (2, -1, 0.5, True):
        with pytest.raises(ValueError, match=rf"row {row!r} is not one of the batch's 2 rows"):
            tally.with_rows([0, row])
        with pytest.raises(ValueError, match=rf"row {row!r} is not one of the batch's 2 rows"):
            tally.add([row])
    assert tally.rows == [] and tally.with_rows([0, 1]) == layout.fed_tokens(batch, [0, 1])


@pytest.mark.parametrize("fill", [0, 1])
@pytest.mark.parametrize("use_cache", [False, True])
def test_a_padded_batch_is_served_whatever_positions_its_padding_carries(fill, use_cache):
    """The model's own attention serves every call without segments: a padded batch whose
    padding positions carry 1 (OpenRLHF's and older generate's cumsum - 1, masked_fill(1))
    or 0, left and right padded, gets the model's own logits, not a packed row's refusal."""
    model, own = tiny_model(), tiny_model()
    enable_segment_attention(model)
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0], [13, 14, 15, 16, 17, 18]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    position_ids = (attention_mask.cumsum(1) - 1).masked_fill(attention_mask == 0, fill)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)
    with torch.no_grad():
        logits, expected = model(**inputs).logits, own(**inputs).logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=0)
    generated = model.generate(input_ids[:1], attention_mask=attention_mask[:1], max_new_tokens=2, do_sample=False)
    assert torch.equal(generated, own.generate(input_ids[:1], attention_mask=attention_mask[:1], max_new_tokens=2,
                                               do_sample=False))


def test_a_packed_row_in_a_padded_batch_is_still_refused():
    """Padding may carry any position; the real tokens of a row must count up, or two
    samples share the row and would attend to each other."""
    model = tiny_model()
    enable_segment_attention(model)
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 14, 15]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 1], [0, 1, 2, 3, 4, 5]])
    for use_cache in (False, True):
        with pytest.raises(ValueError, match="without its segments"):
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)


@pytest.mark.parametrize("layout", ["packed", "shared_prompt", "prefix_tree"])
def test_a_packed_row_goes_only_to_a_model_that_honours_its_segments(layout):
    """A model never enabled, or disabled, dropped attention_segments (transformers passes
    unknown keywords through its own attention, which ignores them) and returned wrong
    hidden states; now model_inputs asks for the model and refuses one whose attention
    cannot confine the row."""
    batch = LAYOUTS[layout].build([[5, 6], [5, 6], [7]], [[8, 9], [10], [11, 12]])
    never, disabled, served = tiny_model(), tiny_model(), tiny_model()
    enable_segment_attention(disabled)
    disable_segment_attention(disabled)
    enable_segment_attention(served)
    for model in (never, disabled):
        with pytest.raises(ValueError, match=r"this model's attention \(sdpa\) is not the segment attention"):
            batch.model_inputs(model)
    with pytest.raises(TypeError, match=r"model_inputs\(model\)"):
        batch.model_inputs()
    with pytest.raises(TypeError, match="model is a Linear"):
        batch.model_inputs(torch.nn.Linear(2, 2))
    wrapped = torch.nn.Module()  # DDP, DeepSpeed and FSDP hold the model as .module
    wrapped.module = served
    assert batch.model_inputs(wrapped)["attention_segments"] is batch.attention_segments
    padded = LAYOUTS["padded"].build([[5, 6]], [[8, 9]], pad_token_id=0)
    assert padded.model_inputs().keys() == padded.model_inputs(never).keys()  # any attention serves padded rows


@pytest.mark.parametrize("architecture", ["mistral", "gemma2"])
def test_sliding_window_models_are_refused_by_name(architecture):
    """Mistral's config slides a 4096-token window by default; Gemma 2 alternates sliding
    and full layers."""
    if architecture == "mistral":
        model = tiny_model("mistral", sliding_window=4096)
    else:
        config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa",
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = Gemma2ForCausalLM(config)
    with pytest.raises(SegmentAttentionUnavailable, match=r"this model's attention \(sdpa\) has sliding-window"):
        enable_segment_attention(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_module_without_a_transformers_config_is_refused():
    for call in (enable_segment_attention, disable_segment_attention):
        with pytest.raises(TypeError, match="model is a Linear: a transformers model"):
            call(torch.nn.Linear(2, 2))
    wrapped = torch.nn.Module()  # DDP, DeepSpeed and FSDP hold the model as .module
    wrapped.module = tiny_model()
    enable_segment_attention(wrapped)
    assert wrapped.module.config._attn_implementation == "hadw_segments_over_sdpa"


@pytest.mark.parametrize(("device", "error"), [("cpux", ValueError), (5.5, TypeError), (None, TypeError)])
def test_a_device_torch_cannot_name_is_refused_naming_the_argument(device, error):
    with pytest.raises(error, match="^device: "):
        LAYOUTS["packed"].build([[5]], [[6]], device=device)


def test_get_layout_names_what_it_was_given():
    for name in (["padded"], None, 3):
        with pytest.raises(ValueError, match=r"unknown layout .*; the layouts are \['packed', 'padded', "):
            get_layout(name)
