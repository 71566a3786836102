"""Where a named model's files are: a hub id or a folder as given, a GGUF file's cached folder
(gguf_folder.py), a GGUF on the hub named as Ollama and llama.cpp name one (`user/repo:Q4_K_M`,
hub_reference.py) downloaded first, or, when no model is named (no `model` option, no `MODEL`
environment variable), the embedded default's (embedded_model.py); and the dtype its config says
it was published in."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from engine.worker.loading.embedded_model import DEFAULT_MODEL_NAME, ensure_default_model
from engine.worker.loading.gguf_folder import ensure_gguf_model
from engine.worker.loading.hub_reference import hub_gguf_file, names_hub_gguf

if TYPE_CHECKING:  # imported where used: a server's front end needs the tokenizer, not torch (~2 s of CPU)
    import torch


def is_gguf_path(model: str | os.PathLike | None) -> bool:
    """A `.gguf` name, a file that starts as GGUF files do (Ollama keeps its models as
    `blobs/sha256-...`, without the extension), or a hub reference written as one to a GGUF
    (`user/repo:Q4_K_M`, `hf.co/user/repo`). A bare `user/repo` names a GGUF only if the repository
    holds GGUF files and no transformers model, which only listing its files tells: resolve_model."""
    if not model:
        return False
    if str(model).lower().endswith(".gguf"):
        return True
    try:
        with open(model, "rb") as file:
            return file.read(4) == b"GGUF"
    except OSError:  # a folder, a hub id
        return not os.path.exists(model) and names_hub_gguf(str(model))


def resolve_model(model: str | None = None) -> str:
    """The folder or hub id to load: `model`, else $MODEL, else the cached embedded default; for
    a GGUF file, the cached folder of its config and tokenizer (see ensure_gguf_model), and for a
    hub reference to a GGUF, that of the file downloaded (hub_reference.hub_gguf_file)."""
    model = model or os.environ.get("MODEL")
    if model and not os.path.exists(model):
        model = hub_gguf_file(model) or model
    if is_gguf_path(model):
        return str(ensure_gguf_model(model))
    if model and model != DEFAULT_MODEL_NAME:
        return model
    return str(ensure_default_model())


def model_dtype(model: str | None = None) -> torch.dtype | None:
    """The dtype `model`'s config says it was published in (None when it says none)."""
    import torch

    path = resolve_model(model)
    config_path = Path(path) / "config.json"
    if config_path.is_file():  # read as json: AutoConfig imports the modelling stack, ~2.5 s of CPU
        raw = json.loads(config_path.read_text())
        dtype = raw.get("dtype") or raw.get("torch_dtype")  # transformers 5's key, then the older one
    else:
        from transformers import AutoConfig
        dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
