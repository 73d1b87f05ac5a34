"""Switching a transformers model onto the segment attention, checked by running it: a
model is switched only where the packed layouts' samples keep to themselves in its
attention (docs/layouts.md, "The segment attention"). Above the builders, which it runs,
and the attention, which it switches to."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import NAME_PREFIX, SegmentAttentionUnavailable, own_attention, registered_name, transformers_model
from .builders import LAYOUTS

if TYPE_CHECKING:  # for the checker only: importing hadw_kernels does not import transformers
    from transformers import PreTrainedModel


def enable_segment_attention(model: torch.nn.Module, *, check: bool = True) -> None:
    """Switches a transformers causal LM to the segment attention over its own attention,
    which keeps serving every call without segments, so that the packed layouts
    (``builders.LAYOUTS``) can feed it; then (``check``) runs three samples through it to
    see that it keeps each sample of a row in every packed layout to itself
    (:func:`keeps_samples_apart`). Skip the check where the model cannot run a forward
    yet (its parameters partitioned by DeepSpeed ZeRO-3 before its engine exists): a
    packed row that reaches an attention without its segments is refused at run time
    either way.

    Raises :class:`SegmentAttentionUnavailable` (a ValueError naming the model's attention
    and why) where it cannot, and leaves the model as it was; a TypeError where ``model``
    is no transformers model (nor a wrapper holding one as ``.module``). Calling it again
    is a no-op."""
    model = transformers_model(model)
    original = own_attention(model)
    if str(model.config._attn_implementation).startswith(NAME_PREFIX):
        return
    name = registered_name(model)
    model.set_attn_implementation(name)
    if check and not keeps_samples_apart(model):
        model.set_attn_implementation(original)
        raise SegmentAttentionUnavailable(
            f"this model's attention ({original}) does not keep the samples of a packed row apart under the segment "
            "attention (a response's hidden states differ from its own run's)")


def keeps_samples_apart(model: PreTrainedModel) -> bool:
    """Whether ``model``'s attention keeps each sample of a packed row to itself in both
    packed layouts: asked of the model, not of a list. Three samples (two sharing a
    prompt) are laid out in every packed layout; each response position must get the
    hidden state it gets alone, and no sample may see another's tokens."""
    embedding = model.get_input_embeddings().weight
    if not isinstance(embedding, torch.Tensor):  # nn.Module's attributes type as a tensor or a module
        raise TypeError(f"the model's input embeddings hold no weight tensor, got {type(embedding).__name__}")
    vocab, device = embedding.shape[0], embedding.device
    generator = torch.Generator().manual_seed(0)

    def tokens(count):
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    # Two samples share a prompt and their responses' first token: a tree two levels deep.
    shared, forked = tokens(3), tokens(4)
    prompts, responses = [tokens(2), shared, shared], [tokens(3), forked, forked[:1] + tokens(2)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = [_response_hidden_states(model, LAYOUTS["padded"].build([prompt], [response], pad_token_id=0,
                                                                            device=device))[0]
                     for prompt, response in zip(prompts, responses)]
            for layout in (layout for layout in LAYOUTS.values() if layout.packs):
                batch = layout.build(prompts, responses, device=device)
                hidden = _response_hidden_states(model, batch)[0]
                for start, length, theirs in zip(batch.response_starts, batch.response_lengths, alone):
                    mine = hidden[start:start + length].float()
                    tolerance = 1e-3 if theirs.dtype in (torch.float32, torch.float64) else 5e-2
                    if (mine - theirs.float()).norm() > tolerance * theirs.float().norm():
                        return False
    except ValueError:  # the model's attention refused the row
        return False
    finally:
        model.train(was_training)
    return True


def _response_hidden_states(model, batch) -> torch.Tensor:
    # The model is asked, not its name: its own inputs, whatever attention it runs.
    inputs = batch.model_inputs() if batch.attention_segments is None else batch._packed_inputs()
    outputs = model(**inputs, use_cache=False, output_hidden_states=True,
                    logits_to_keep=torch.empty(0, dtype=torch.long, device=batch.input_ids.device))
    return batch.loss_hidden_states(outputs.hidden_states[-1])
