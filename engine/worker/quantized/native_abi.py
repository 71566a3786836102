"""What Python shares with the native library (native_abi.h): its structures declared for ctypes,
and its constants.

The constants are read from the header's text when this module is imported, not asked of the
library: matrix.py lays out a GGUF file's weights with them, and every engine imports it, also
where no C compiler builds the library (then the weights are dequantized from that layout) and
on GPUs, where building a library at import only to learn 8 and 32 would cost a compile. The
library reports the values it was built with too, and the loader refuses it where they differ.
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).with_name("native_abi.h")
CONSTANT_NAMES = ("LANES", "CHUNK", "SPAN_VALUES", "X_LIMIT", "BATCH_ROWS")


def header_constants(text: str) -> dict[str, int]:
    """The integer `#define`s of CONSTANT_NAMES in a header's text."""
    found = {name: int(value) for name, value in re.findall(r"^\s*#define\s+(\w+)\s+(-?\d+)\b", text, re.MULTILINE)}
    missing = [name for name in CONSTANT_NAMES if name not in found]
    if missing:
        raise RuntimeError(f"{HEADER.name} defines no integer {', '.join(missing)}")
    return {name: found[name] for name in CONSTANT_NAMES}


CONSTANTS = header_constants(HEADER.read_text())

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Part(ctypes.Structure):
    """One quantized matrix of a linear layer and its first output column."""
    _fields_ = [("q", _P), ("d", _P), ("dm", _P), ("sc", _P), ("mn", _P),
                ("gs", _I), ("sg", _I), ("bits", _I), ("shift", _I), ("blocks", _I), ("column", _I),
                ("span", _I)]


class Scratch(ctypes.Structure):
    """Where the loops quantize a row's activations."""
    _fields_ = [("xq", _P), ("dx", _P), ("xsum", _P), ("xqsum", _P)]


class Layer(ctypes.Structure):
    """One decoder layer's weights and its part of the paged cache (decode_layers.c)."""
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("qkv_parts", _I), ("qkv_bias", _P),
                ("o", _P), ("o_parts", _I), ("gate_up", _P), ("gate_up_parts", _I), ("down", _P),
                ("down_parts", _I), ("k_cache", _P), ("v_cache", _P)]


class Step(ctypes.Structure):
    """A decode step's shapes, tokens and room (decode_layers.c)."""
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("ffn", _I), ("levels", _I),
                ("eps", _F), ("scale", _F), ("block_size", _I), ("block_stride", _I), ("rows", _I), ("cos_sin", _P),
                ("slots", _P), ("block_tables", _P), ("table_stride", _I), ("contexts", _P),
                ("shared_blocks", _I), ("softmax", _P), ("scratch", Scratch),
                ("x", _P), ("qkv", _P), ("attn", _P), ("delta", _P), ("gate_up", _P),
                ("x_stride", _I), ("qkv_stride", _I), ("attn_stride", _I), ("delta_stride", _I), ("gate_up_stride", _I),
                ("final_norm", _P), ("head", _P), ("head_parts", _I), ("logits", _P), ("logits_stride", _I)]


STRUCTURES: dict[str, type[ctypes.Structure]] = {"Part": Part, "Scratch": Scratch, "Layer": Layer, "Step": Step}
