"""How a GGUF file's quantized weights run: kept quantized and multiplied by the native loops, or
made dense at load; chosen from the `quantization` option, the file, the device and the memory."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.worker.loading.embedded_model import DEFAULT_MODEL_NAME
from engine.worker.loading.gguf_folder import gguf_source
from engine.worker.loading.model_files import resolve_model

if TYPE_CHECKING:
    import torch

# A GGUF file's quantized weights: kept quantized (native, CPU), made dense at load, or picked.
QUANTIZATIONS = ("auto", "native", "dequantize")


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
        from engine.worker.loading.gguf_formats import QUANTIZED_TYPES
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
