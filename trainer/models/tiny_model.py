"""A tiny random-weight causal LM and a word-level tokenizer, built offline.

The tokenizer is trained on nothing: a fixed word list becomes a ``WordLevel`` vocabulary
split on whitespace, wrapped in ``PreTrainedTokenizerFast``. ``padding_side`` goes to the
constructor (set afterwards, it is not saved). The tokenizer is saved to its own
directory, not the model's: a qwen2 model directory reloads its tokenizer as
``Qwen2Tokenizer``, whose ids differ from the raw tokenizer.json. The engines are fed
token ids and never load a tokenizer, so both architectures behave alike.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

MAX_POSITIONS = 256


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocabulary = {word: index for index, word in enumerate(words)}
    raw = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins tokens with spaces, so "7 8" decodes to two numbers.
    raw.decoder = decoders.WordPiece()
    raw.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", vocabulary["[BOS]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        padding_side="left",
    )


def build_tiny_model(model_config, tokenizer: PreTrainedTokenizerFast, seed: int,
                     positions: int = MAX_POSITIONS) -> PreTrainedModel:
    """A Llama or Qwen2 model with random weights drawn from ``seed``, for sequences of up
    to ``positions`` tokens (at least MAX_POSITIONS)."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=model_config.hidden_size,
        intermediate_size=model_config.intermediate_size,
        num_hidden_layers=model_config.num_layers,
        num_attention_heads=model_config.num_heads,
        num_key_value_heads=model_config.num_heads,
        head_dim=model_config.head_dim,
        max_position_embeddings=max(MAX_POSITIONS, positions),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Untied: the LM head the loss reads is then a parameter of its own.
        tie_word_embeddings=False,
    )
    config: PreTrainedConfig
    model_class: type[PreTrainedModel]
    if model_config.architecture == "llama":
        config, model_class = LlamaConfig(**common), LlamaForCausalLM
    else:
        config, model_class = Qwen2Config(**common), Qwen2ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_class(config)


def save_initial_model(model: PreTrainedModel, tokenizer, model_dir: Path, tokenizer_dir: Path) -> None:
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)
