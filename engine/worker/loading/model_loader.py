"""A named model's parts as the engine takes them: its checkpoint (read directly from a Llama
folder's safetensors or a GGUF file, else through transformers), its tokenizer and its
end-of-sequence id. Any Llama-family model loads by hub id, local folder or GGUF file path
(model_files.py finds its files); other architectures are refused before any weights are read."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.worker.loading.architectures import check_architecture
from engine.worker.loading.gguf_folder import gguf_source
from engine.worker.loading.model_files import resolve_model
from engine.worker.loading.tokenizer_files import eos_token_id_at, tokenizer_at

if TYPE_CHECKING:
    import torch


def load_tokenizer(model: str | None = None):
    """`model`'s tokenizer (tokenizer_files.tokenizer_at its folder)."""
    return tokenizer_at(resolve_model(model))


def eos_token_id(model: str | None = None) -> int | None:
    """The id of `model`'s end-of-sequence token: an engine core needs it, not the tokenizer."""
    return eos_token_id_at(resolve_model(model))


def check_supported(config) -> None:
    check_architecture(getattr(config, "model_type", None), "model type")


def load_hf_model(model: str | None = None, dtype: torch.dtype | None = None, quantized: bool = False):
    """(transformers model in eval mode, tokenizer) for `model`; refuses unsupported architectures
    before loading any weights (`dtype`: float32 unless given). `quantized`: a GGUF file's
    quantized matrices stay quantized (gguf_file.load_model), for a `resolve_quantization` of
    "native"."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32
    path = resolve_model(model)
    config = AutoConfig.from_pretrained(path)
    check_supported(config)
    if (source := gguf_source(path)) is not None:
        from engine.worker.loading.gguf_file import load_model
        return load_model(source["path"], config, dtype, quantized=quantized), tokenizer_at(path)
    if quantized:
        raise ValueError(f"{model} has no quantized weights to keep: only GGUF files do")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_model.eval()
    return hf_model, tokenizer_at(path)


def load_checkpoint(model: str | None = None, dtype: torch.dtype | None = None, quantized: bool = False):
    """`model`'s checkpoint, what the engine's decoder takes (checkpoint.py): read directly from a
    Llama folder's safetensors or a Llama GGUF file where checkpoint.read_folder or
    gguf_file.read_checkpoint can, else taken from load_hf_model's transformers model. Refuses
    unsupported architectures before any weights."""
    import torch

    from engine.worker.loading.checkpoint import of_transformers, read_folder

    dtype = dtype or torch.float32
    path = resolve_model(model)
    if (source := gguf_source(path)) is not None:
        from engine.worker.loading.gguf_file import read_checkpoint
        checkpoint = read_checkpoint(source["path"], json.loads((Path(path) / "config.json").read_text()), dtype, quantized)
    else:
        checkpoint = None if quantized else read_folder(path, dtype)
    return checkpoint if checkpoint is not None else of_transformers(load_hf_model(model, dtype, quantized=quantized)[0])
