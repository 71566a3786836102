"""What Python shares with the native library (native_abi.h): its structures declared for ctypes,
its constants, and the check that a built library lays them out as declared here.

ctypes cannot read a C header, so every structure is declared twice, and a field moved on one
side only would have the C loops read pointers where Python wrote counts. The library therefore
reports each shared structure's size and its fields' offsets and sizes as its compiler laid them
out (native_abi.c), and `abi_problem` compares them with the ctypes declarations; the loader
(native.py) refuses a library it finds a problem with.

The constants are read from the header's text when this module is imported, not asked of the
library: matrix.py lays out a GGUF file's weights with them, and every engine imports it, also
where no C compiler builds the library (then the weights are dequantized from that layout) and
on GPUs, where building a library at import only to learn 8 and 32 would cost a compile. The
library reports the values it was built with too, and the loader refuses it where they differ.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
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
    _fields_ = [("q", _P), ("d", _P), ("dm", _P), ("sc", _P), ("mn", _P), ("table", _P),
                ("gs", _I), ("sg", _I), ("bits", _I), ("shift", _I), ("blocks", _I), ("column", _I),
                ("span", _I)]


class Scratch(ctypes.Structure):
    """Where the loops quantize a row's activations."""
    _fields_ = [("xq", _P), ("dx", _P), ("xsum", _P), ("xqsum", _P)]


class Layer(ctypes.Structure):
    """One decoder layer's weights and its part of the paged cache (native_layers.c)."""
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("qkv_parts", _I), ("qkv_bias", _P),
                ("o", _P), ("o_parts", _I), ("gate_up", _P), ("gate_up_parts", _I), ("down", _P),
                ("down_parts", _I), ("k_cache", _P), ("v_cache", _P)]


class Step(ctypes.Structure):
    """A decode step's shapes, tokens and room (native_layers.c)."""
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("ffn", _I), ("levels", _I),
                ("eps", _F), ("scale", _F), ("block_size", _I), ("block_stride", _I), ("rows", _I), ("cos_sin", _P),
                ("slots", _P), ("block_tables", _P), ("table_stride", _I), ("contexts", _P),
                ("shared_blocks", _I), ("softmax", _P), ("scratch", Scratch),
                ("x", _P), ("qkv", _P), ("attn", _P), ("delta", _P), ("gate_up", _P),
                ("x_stride", _I), ("qkv_stride", _I), ("attn_stride", _I), ("delta_stride", _I), ("gate_up_stride", _I),
                ("final_norm", _P), ("head", _P), ("head_parts", _I), ("logits", _P), ("logits_stride", _I)]


STRUCTURES: dict[str, type[ctypes.Structure]] = {"Part": Part, "Scratch": Scratch, "Layer": Layer, "Step": Step}


class _FieldRow(ctypes.Structure):
    """native_abi.c's FieldRow: field None gives the structure's size."""
    _fields_ = [("structure", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _I), ("size", _I)]


class _ConstantRow(ctypes.Structure):
    """native_abi.c's ConstantRow."""
    _fields_ = [("name", ctypes.c_char_p), ("value", _I)]


@dataclass
class Layout:
    """A structure as the library's compiler laid it out: its size and (field, offset, size) in
    the header's order."""
    size: int
    fields: list[tuple[str, int, int]]


def _rows(lib: ctypes.CDLL, name: str, row: type[ctypes.Structure]) -> ctypes.Array:
    function = getattr(lib, name)  # AttributeError: not exported
    function.argtypes, function.restype = [ctypes.POINTER(ctypes.POINTER(row))], _I
    start = ctypes.POINTER(row)()
    count = function(ctypes.byref(start))
    return ctypes.cast(start, ctypes.POINTER(row * count)).contents


def reported_layout(lib: ctypes.CDLL) -> dict[str, Layout]:
    """The shared structures as `lib` reports them, by name."""
    layouts: dict[str, Layout] = {}
    for row in _rows(lib, "native_layout", _FieldRow):
        layout = layouts.setdefault(row.structure.decode(), Layout(0, []))
        if row.field is None:
            layout.size = row.size
        else:
            layout.fields.append((row.field.decode(), row.offset, row.size))
    return layouts


def reported_constants(lib: ctypes.CDLL) -> dict[str, int]:
    """The shared constants' values `lib` was built with."""
    return {row.name.decode(): row.value for row in _rows(lib, "native_constants", _ConstantRow)}


def structure_problems(name: str, structure: type[ctypes.Structure], layout: Layout) -> list[str]:
    """Where ctypes' `structure` differs from the library's `layout` of native_abi.h's `name`:
    each field (by name) at the same offset with the same size, no field on one side only, the
    same size; and no gap in the layout a missing row of native_abi.c's table would leave."""
    problems = []
    ours = {field: (getattr(structure, field).offset, getattr(structure, field).size)
            for field, *_ in structure._fields_}
    theirs = {field: (offset, size) for field, offset, size in layout.fields}
    for field, (offset, size) in ours.items():
        if field not in theirs:
            problems.append(f"{name}.{field} is declared in ctypes (offset {offset}) but the library's {name} "
                            f"has no such field")
        elif theirs[field][0] != offset:
            problems.append(f"{name}.{field} is at offset {theirs[field][0]} in the library but {offset} in ctypes")
        elif theirs[field][1] != size:
            problems.append(f"{name}.{field} is {theirs[field][1]} bytes in the library but {size} in ctypes")
    problems += [f"{name}.{field} (offset {offset}) is in the library's {name} but not declared in ctypes"
                 for field, (offset, _) in theirs.items() if field not in ours]
    if layout.size != ctypes.sizeof(structure):
        problems.append(f"{name} is {layout.size} bytes in the library but {ctypes.sizeof(structure)} in ctypes")
    # Padding before a field is less than its alignment (at most 8 here): a wider gap is a field
    # the table leaves out, whose neighbours could then move unseen.
    end = 0
    for field, offset, size in sorted(layout.fields, key=lambda f: f[1]) + [("", layout.size, 8)]:
        if offset - end >= min(size, 8):
            problems.append(f"native_abi.c lists no field of {name} in bytes {end}..{offset}: "
                            f"a field of native_abi.h is missing from its table")
        end = max(end, offset + size)
    return problems


def abi_problem(lib: ctypes.CDLL, structures: dict[str, type[ctypes.Structure]] = STRUCTURES,
                constants: dict[str, int] = CONSTANTS) -> str | None:
    """Why `lib` must not be called with these ctypes `structures` and header `constants`, or None
    when its report matches them all."""
    try:
        layouts, values = reported_layout(lib), reported_constants(lib)
    except AttributeError as error:
        return f"it does not report its layout ({error}): not built from native_abi.c"
    problems = []
    for name, structure in structures.items():
        if name in layouts:
            problems += structure_problems(name, structure, layouts[name])
        else:
            problems.append(f"the library reports no structure {name}")
    for name, value in constants.items():
        if values.get(name) != value:
            problems.append(f"{name} is {values.get(name)} in the library but {value} in {HEADER.name}")
    return "; ".join(problems) or None
