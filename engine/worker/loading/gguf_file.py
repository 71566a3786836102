"""A GGUF file by path (or the first part of a split model, read as one: gguf_split.py): what it
holds, whether we serve it, and its weights, as the engine's checkpoint (`read_checkpoint`, for
Llama files) or as a transformers model (`load_model`).

Read with the `gguf` package's GGUFReader (llama.cpp's own reader), never by hand. `inspect_gguf`
refuses a file before anything else touches it: an architecture other than llama, mistral or
qwen2, or a tensor in a type `gguf_formats` does not read (named with the tensor). Both readers
dequantize each tensor with `gguf_formats` straight from the memory-mapped file into the dtype
the engine runs in (one tensor in float32 at a time), so a 7B file never becomes a dense copy on
disk; tensor names and llama.cpp's query/key row order are mapped back to transformers' as
transformers' own GGUF loader maps them, and Llama 3's `rope_freqs` (which that loader drops) is
applied to the rotary frequencies as llama.cpp applies it.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.worker.loading import gguf_formats
from engine.worker.loading.architectures import UnsupportedModelError, check_architecture
from engine.worker.loading.gguf_split import SplitGGUF, open_split

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFInfo:
    path: str
    architecture: str
    name: str | None
    file_type: str        # as llama.cpp names it (general.file_type), e.g. "Q4_K_M"; else main_type
    main_type: str        # the tensor type most weights are in, e.g. "Q4_K"
    size_bytes: int
    num_parameters: int
    weights_by_type: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        return (f"{Path(self.path).name}: {self.architecture}, {self.file_type}, "
                f"{self.num_parameters / 1e9:.2f}B parameters, {self.size_bytes / 2**20:.0f} MiB")


def _reader_class():
    import numpy as np
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """gguf's reader, reading through a plain ndarray view of its memory map: slicing an
        np.memmap costs ~15 us a slice, and the reader slices ~5 times for each of a vocabulary's
        strings (SmolLM2's 49k tokens and merges: 6.4 s of CPU to open the file, 2.3 s this way)."""

        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, value):
            self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader


def open_reader(path: str | Path):
    """GGUFReader over the file, memory-mapped copy-on-write: its tensors are writable numpy
    arrays (what torch.from_numpy wants) and the file is never written. For the first part of a
    split model, every part's reader joined as one (gguf_split.open_split)."""
    return open_split(Path(path), _open_one)


def _open_one(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return _reader_class()(path, mode="c")
    except ValueError as error:  # bad magic, unsupported GGUF version
        raise ValueError(f"{path} is not a GGUF file we can read: {error}") from None


def field_value(reader, key: str, default=None):
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def inspect_gguf(path: str | Path, reader=None) -> GGUFInfo:
    """What the GGUF at `path` holds; raises UnsupportedModelError for an architecture or a
    tensor type we do not serve."""
    from gguf import LlamaFileType

    reader = reader or open_reader(path)
    architecture = field_value(reader, "general.architecture")
    check_architecture(architecture, f"{Path(path).name}: GGUF architecture")
    weights = Counter()
    for tensor in reader.tensors:
        try:
            qtype = gguf_formats.check_type(tensor.tensor_type)
        except gguf_formats.UnsupportedTensorTypeError as error:
            raise UnsupportedModelError(f"{Path(path).name}: tensor {tensor.name!r}: {error}") from None
        weights[qtype.name] += int(tensor.n_elements)
    main_type = weights.most_common(1)[0][0] if weights else "none"
    parts = reader.paths if isinstance(reader, SplitGGUF) else [Path(path)]
    file_type = field_value(reader, "general.file_type")
    try:
        file_type = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        file_type = main_type
    return GGUFInfo(path=os.path.abspath(path), architecture=architecture, name=field_value(reader, "general.name"),
                    file_type=file_type, main_type=main_type,
                    size_bytes=sum(part.stat().st_size for part in parts),
                    num_parameters=sum(weights.values()), weights_by_type=dict(weights))


def load_model(path: str | Path, config, dtype: torch.dtype, quantized: bool = False):
    """A transformers causal LM with `config` (the file's, as AutoConfig reads it) and the file's
    weights dequantized into `dtype`, in eval mode.

    `quantized`: the quantized matrices (the projections and the embedding) stay as they are in
    the file, as `QuantizedMatrix`es in the model's `quantized_weights` (transformers' parameter
    name -> matrix), and the model's own parameters of those names stay on the meta device (no
    memory): only the engine's decoder (models/weights.py) reads them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    reader = open_reader(path)
    info = inspect_gguf(path, reader)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        hf_names = model_class(config).state_dict()
    state_dict, kept, rope_factors = _read_tensors(reader, info, hf_names, config.to_dict(), dtype, quantized)
    if kept:
        model = _model_without(kept, model_class, config, state_dict, dtype)
    else:
        model = model_class.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)
    model.quantized_weights = kept
    if rope_factors is not None:
        _divide_rope_frequencies(model, rope_factors)
    return model.eval()


def read_checkpoint(path: str | Path, raw_config: dict, dtype: torch.dtype, quantized: bool = False):
    """What load_model's model gives the engine (checkpoint.of_transformers of it), read without
    building that model, for a Llama file whose config (`raw_config`: its cached folder's
    config.json) checkpoint.llama_config reads; None for any other, to go through load_model."""
    from engine.worker.loading.checkpoint import Checkpoint, llama_config, llama_parameter_names, rotary_inv_freq

    described = llama_config(raw_config)
    if described is None:
        return None
    config, rope = described
    reader = open_reader(path)
    info = inspect_gguf(path, reader)
    num_layers = config.num_hidden_layers
    state_dict, kept, rope_factors = _read_tensors(reader, info, llama_parameter_names(num_layers, False, config.qkv_bias),
                                                   vars(config), dtype, quantized)
    tied = bool(config.tie_word_embeddings)
    if tied:  # as transformers ties it: the head is the embedding, whatever the file holds
        state_dict.pop("lm_head.weight", None)
        kept.pop("lm_head.weight", None)
    missing = [name for name in llama_parameter_names(num_layers, tied, config.qkv_bias)
               if name not in state_dict and name not in kept]
    if missing:
        raise ValueError(f"{missing[:5]} missing from the GGUF file")
    inv_freq = rotary_inv_freq(config, rope)
    if rope_factors is not None:
        inv_freq = inv_freq / rope_factors.to(inv_freq)
    return Checkpoint(config=config, parameters=state_dict, inv_freq=inv_freq, tied=tied, quantized=kept)


def _read_tensors(reader, info: GGUFInfo, hf_names, config: dict, dtype: torch.dtype, quantized: bool):
    """(state_dict, kept, rope factors) of the file: the tensors named in `hf_names` (transformers'
    names) by those names, dequantized into `dtype`, or, where `quantized`, its quantized matrices
    as QuantizedMatrix in `kept`; Llama 3's `rope_freqs` factors (None when the file has none)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    logger.info("loading %s, %s", info.describe(),
                "its quantized matrices kept quantized" if quantized else f"dequantized to {str(dtype).removeprefix('torch.')}")
    names = gguf_names(hf_names, info.architecture, config["num_hidden_layers"])
    processor = TENSOR_PROCESSORS.get(info.architecture, TensorProcessor)(config=config)
    state_dict, kept, rope_factors = {}, {}, None
    for tensor in reader.tensors:
        raw = torch.from_numpy(tensor.data)
        shape = tuple(reversed([int(n) for n in tensor.shape]))
        name = names.get(tensor.name)
        if quantized and name is not None and len(shape) == 2 and tensor.tensor_type in gguf_formats.QUANTIZED_TYPES:
            kept[name] = _quantized_matrix(raw, tensor, shape, processor)
            continue
        weights = gguf_formats.dequantize(raw, tensor.tensor_type).reshape(shape)
        if tensor.name == "rope_freqs.weight":
            rope_factors = weights.clone()
        if name is None:
            continue
        weights = processor.process(weights=weights, name=tensor.name).weights  # llama.cpp's q/k row order undone
        # a copy even in the file's own dtype: a view would keep the whole file mapped (and resident)
        state_dict[name] = weights.to(dtype, copy=True)
    return state_dict, kept, rope_factors


def _quantized_matrix(raw: torch.Tensor, tensor, shape: tuple[int, ...], processor):
    """The tensor's groups as a QuantizedMatrix, rows in transformers' order: the processor's row
    permutation (llama.cpp's q/k order undone) is found by applying it to the row numbers."""
    from engine.worker.quantized.matrix import QuantizedMatrix

    groups = gguf_formats.unpack(raw.reshape(shape[0], -1), tensor.tensor_type)
    rows = torch.arange(shape[0], dtype=torch.float64).reshape(shape[0], 1)
    order = processor.process(weights=rows, name=tensor.name).weights.reshape(-1).long()
    if not torch.equal(order, torch.arange(shape[0])):
        groups = replace(groups, **{part: getattr(groups, part)[order] for part in ("quants", "d", "sc", "dm", "mn")
                                    if getattr(groups, part) is not None})
    return QuantizedMatrix.of(groups, gguf_formats.check_type(tensor.tensor_type).name)


def _model_without(kept: dict, model_class, config, state_dict: dict, dtype: torch.dtype):
    """The model with `state_dict` loaded and the parameters named in `kept` left on the meta
    device; buffers computed at construction (the rotary frequencies) rebuilt on the CPU."""
    with torch.device("meta"):
        model = model_class(config)
    model.to(dtype)
    missing = set(model.state_dict()) - set(state_dict) - set(kept)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{sorted(missing)[:5]} missing from the GGUF file")
    model.load_state_dict(state_dict, strict=False, assign=True)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)
    return model


def gguf_names(hf_names, architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, by gguf-py's tensor name map (what
    transformers' get_gguf_hf_weights_map does, with the map built once rather than once per
    module: 12 s of SmolLM2's load). A "mistral" file lays its tensors out as llama's."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_name = "qwen2" if architecture == "qwen2" else "llama"
    arch = next(arch for arch, name in MODEL_ARCH_NAMES.items() if name == arch_name)
    name_map = get_tensor_name_map(arch, num_layers)
    names = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _divide_rope_frequencies(model, factors: torch.Tensor) -> None:
    """Llama 3.1/3.2 files carry their RoPE scaling as `rope_freqs.weight`, one factor per
    frequency that llama.cpp divides it by; transformers' GGUF config leaves it out, so the
    model's frequencies are divided here (what engine/worker/models' rotary table reads)."""
    rotary = model.model.rotary_emb
    scaled = rotary.inv_freq / factors.to(rotary.inv_freq)
    rotary.register_buffer("inv_freq", scaled, persistent=False)
    if hasattr(rotary, "original_inv_freq"):
        rotary.original_inv_freq = scaled
