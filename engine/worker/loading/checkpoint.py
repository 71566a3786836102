"""What the engine takes from a model: its config, its weights by transformers' parameter names, and
its rotary frequencies.

A Llama or Qwen2 folder of safetensors (the embedded default's converted folder, a transformers
save, a hub snapshot on disk) is read directly: the config from config.json, the tensors into
memory of their own (safetensors_file.py), the rotary frequencies computed as transformers computes
them; a Llama or Qwen2 GGUF file likewise (gguf_file.read_checkpoint, with its cached folder's config.json). Building the
transformers model instead imports transformers' modelling stack, which pulls in torch._dynamo,
triton and torch.distributed.tensor: ~3-5 s of CPU on a 2-core EPYC at every start of an engine,
its core process or a compiled step's build, and ~160 MiB of resident memory, for weights the
engine copies out at once anyway. Anything else (a hub id, Mistral folders or files, sliding windows,
other RoPE scalings, a config that leaves out what we would have to guess) goes through the
transformers model (`of_transformers`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine.worker.loading.safetensors_file import read_tensors
from engine.worker.quantized.matrix import QuantizedMatrix

# The rotary scalings computed here; any other goes through transformers.
ROPE_TYPES = ("default", "llama3")
# What a config.json must spell out to be read here (transformers' defaults for the rest are
# LlamaConfig's, which this module repeats only for keys whose default is plain).
REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
READ_TYPES = ("llama", "qwen2")  # config.json's model_type: the families read here
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                  "head_dim": None}


@dataclass
class Checkpoint:
    """A decoder's config (a transformers config, or config.json's keys as attributes), its
    weights by transformers' names, the GGUF matrices kept quantized, and its rotary frequencies
    (fp32) and cos/sin scaling. When `tied`, the output head is the input embedding, whatever
    `parameters` holds under lm_head.weight (a folder's read leaves it out)."""
    config: Any
    parameters: dict[str, torch.Tensor]
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    tied: bool = False
    quantized: dict[str, QuantizedMatrix] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


def as_checkpoint(source) -> Checkpoint:
    """`source` itself when it is a Checkpoint, else what of_transformers takes from it."""
    return source if isinstance(source, Checkpoint) else of_transformers(source)


def of_transformers(hf_model) -> Checkpoint:
    """The checkpoint of a transformers model (a GGUF file's quantized matrices ride on it as
    `quantized_weights`, their parameters on the meta device)."""
    rotary = hf_model.model.rotary_emb
    return Checkpoint(config=hf_model.config, parameters=dict(hf_model.named_parameters(remove_duplicate=False)),
                      inv_freq=rotary.inv_freq.detach().float(),
                      attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)), tied=_tied(hf_model),
                      quantized=getattr(hf_model, "quantized_weights", None) or {})


def _tied(hf_model) -> bool:
    """The output embedding is the input one (a quantized model's are on the meta device, where
    storage cannot tell: its config says)."""
    inner, head = hf_model.model.embed_tokens.weight, hf_model.get_output_embeddings().weight
    if head.is_meta or inner.is_meta:
        return bool(getattr(hf_model.config, "tie_word_embeddings", False))
    return head.data_ptr() == inner.data_ptr()


def read_folder(path: str | Path, dtype: torch.dtype) -> Checkpoint | None:
    """The checkpoint of a local Llama folder of safetensors, its weights in `dtype` (as
    transformers' `from_pretrained(path, dtype=dtype)` holds them); None where this module does
    not read it (see the module's docstring), for the caller to load it through transformers."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        return None
    described = llama_config(json.loads(config_path.read_text()))
    if described is None:
        return None
    config, rope = described
    files = _safetensors_files(folder)
    if files is None:
        return None
    parameters = {}
    for file in files:
        parameters.update(read_tensors(file, dtype))
    tied = bool(config.tie_word_embeddings)
    if tied:
        parameters.pop("lm_head.weight", None)
    if not _complete(parameters, config.num_hidden_layers, tied, config.qkv_bias):
        return None
    return Checkpoint(config=config, parameters=parameters, inv_freq=rotary_inv_freq(config, rope), tied=tied)


def llama_config(raw: dict) -> tuple[SimpleNamespace, dict] | None:
    """config.json's keys (`raw`) as the engine reads a config, with its rotary parameters; None
    for what this module does not read (another family, a quantization config, a key left out
    that transformers would default, another RoPE scaling)."""
    if raw.get("model_type") not in READ_TYPES or "quantization_config" in raw or any(k not in raw for k in REQUIRED_KEYS):
        return None
    if raw.get("use_sliding_window") or raw.get("attention_bias") or raw.get("mlp_bias"):
        return None  # attention or biases this module does not read: transformers' model does
    rope = _rope_parameters(raw)
    if rope is None:
        return None
    config = SimpleNamespace(**(LLAMA_DEFAULTS | raw))
    config.num_key_value_heads = raw.get("num_key_value_heads") or config.num_attention_heads
    config.rope_parameters = rope
    # Qwen2 is Llama with biases on q, k and v (transformers' Qwen2Attention): read like it.
    config.qkv_bias = raw["model_type"] == "qwen2"
    return config, rope


def _rope_parameters(raw: dict) -> dict | None:
    """config.json's rotary parameters in transformers 5's form (`rope_parameters`), from either
    that or the older `rope_theta` + `rope_scaling`; None for a scaling not computed here."""
    rope = raw.get("rope_parameters")
    if rope is None:
        scaling = raw.get("rope_scaling") or {}
        rope = {"rope_theta": raw.get("rope_theta", 10000.0), **scaling,
                "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
    if rope.get("rope_type", "default") not in ROPE_TYPES or "rope_theta" not in rope:
        return None
    return {"rope_type": "default", **rope}


def rotary_inv_freq(config: SimpleNamespace, rope: dict) -> torch.Tensor:
    """The rotary frequencies as transformers' LlamaRotaryEmbedding computes them (default: its
    `compute_default_rope_parameters`; llama3: modeling_rope_utils' llama 3.1 scaling), op for op,
    so the tables are the same to the bit."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    if rope["rope_type"] == "default":
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _safetensors_files(folder: Path) -> list[Path] | None:
    """The folder's weight files: model.safetensors, or the shards its index names."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if all((folder / shard).is_file() for shard in shards):
            return [folder / shard for shard in shards]
    return None


def llama_parameter_names(num_layers: int, tied: bool, qkv_bias: bool = False) -> list[str]:
    """Every weight the engine reads of a Llama decoder (with `qkv_bias`: a Qwen2's), by
    transformers' names."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        names += [f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
        names += [f"{prefix}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if qkv_bias:
            names += [f"{prefix}.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
        names += [f"{prefix}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def _complete(parameters: dict[str, torch.Tensor], num_layers: int, tied: bool, qkv_bias: bool) -> bool:
    """Every weight the engine reads is in the files (transformers would make up a missing one)."""
    return all(name in parameters for name in llama_parameter_names(num_layers, tied, qkv_bias))
