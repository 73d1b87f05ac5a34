"""Writes a tiny random Llama as a GGUF file the way llama.cpp's converter lays one out
(tensor names, the q/k row permutation, a byte-level BPE tokenizer with a ChatML chat
template), for the tests of the GGUF conversion path. Holds no tests itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

ROPE_THETA = 10000.0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "Tom has 3 apples and gets 4 more. How many apples does Tom have now? The final answer is 7.",
    "Anna has 12 books, gives away 5 and buys 2. How many books are left? 12 - 5 + 2 = 9.",
    "What is 45 plus 38? Give the final answer as a number. 0123456789 + - = ?",
]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved); transformers undoes it."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> torch.nn.Module:
    """Writes the GGUF file and returns the Llama it holds (float32, random weights)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer()
    vocabulary = tokenizer.get_vocab()
    tokens = sorted(vocabulary, key=vocabulary.get)
    merges = [" ".join(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]
    ids = {token: vocabulary[token] for token in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
        bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|im_end|>"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float().eval()

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids["<|im_start|>"])
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_unk_token_id(ids["<|endoftext|>"])
    writer.add_pad_token_id(ids["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        weight = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied to the embedding
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gguf_name = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                weight = _permute(weight, config.num_attention_heads)
            elif module == "self_attn.k_proj":
                weight = _permute(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
