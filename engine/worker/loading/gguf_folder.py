"""A GGUF file's config and tokenizer as a small transformers folder, read from the file once into
the cache directory, keyed by the file's path, size and modification time (an edited or replaced
file gets a new folder; a split model's, by all of its parts'). Its weights are never written out:
they are read from the file itself at every load (gguf_file.py)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.worker.cache_folders import cache_dir
from engine.worker.loading.gguf_split import split_files

GGUF_SOURCE = "gguf_source.json"  # in a GGUF's cached folder: the file its weights are read from


def ensure_gguf_model(path: str | os.PathLike) -> Path:
    """The cached folder for the GGUF file at `path`: its config (with the dtype the file's main
    weight type suggests) and tokenizer, written on first use after the file passed
    gguf_file.inspect_gguf's checks, and `gguf_source.json` naming the file. Keyed by the file's
    absolute path, size and mtime (every part's, for a split model), so an edited or replaced file
    gets a new folder. The path is kept as named, not resolved: a hub cache's file is a link to a
    blob named by its hash, and a split model's parts are found by their names beside it."""
    source = Path(os.path.abspath(Path(path).expanduser()))
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    parts = [part.stat() for part in split_files(source) if part.is_file()]
    stats = "".join(f"\0{stat.st_size}\0{stat.st_mtime_ns}" for stat in parts)
    key = hashlib.sha256(f"{source}{stats}".encode()).hexdigest()[:16]
    folder = cache_dir() / "gguf" / f"{source.stem}-{key}"
    if (folder / GGUF_SOURCE).exists():
        return folder
    from engine.worker.loading.gguf_file import inspect_gguf, open_reader  # torch: a first use's only

    reader = open_reader(source)
    info = inspect_gguf(source, reader)  # refusals first: nothing else has read the file yet
    # transformers ties the head to the embedding when the file has no `output.weight`, looking at
    # the first file only: a split model's head may be in another part
    tied = all(tensor.name != "output.weight" for tensor in reader.tensors)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a client and its core starting at once write it once
        if (folder / GGUF_SOURCE).exists():
            return folder
        _write_gguf_folder(source, info, folder, tied)
    return folder


def _write_gguf_folder(source: Path, info, folder: Path, tied: bool) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = tied
    # The dtype the weights were published in, which dtype="auto" goes by: a 16-bit file's own;
    # a quantized file's was 16 bits (llama.cpp quantizes from those) and bf16 holds its values.
    config.dtype = {"F32": "float32", "F16": "float16"}.get(info.main_type, "bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {"path": str(source), "size": info.size_bytes, "mtime_ns": source.stat().st_mtime_ns,
                  "architecture": info.architecture, "file_type": info.file_type, "main_type": info.main_type,
                  "num_parameters": info.num_parameters}
        (staging / GGUF_SOURCE).write_text(json.dumps(record, indent=2) + "\n")
        if folder.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(folder)
        staging.rename(folder)  # atomic: a folder with gguf_source.json is always complete
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def gguf_source(folder: str | os.PathLike) -> dict | None:
    """What `gguf_source.json` in a GGUF's cached folder records (None for any other model)."""
    record = Path(folder) / GGUF_SOURCE
    return json.loads(record.read_text()) if record.is_file() else None
