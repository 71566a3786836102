"""A safetensors file's tensors read into memory the engine owns, one tensor at a time.

`safetensors.torch.load_file` maps the whole file and hands out views into the mapping: every page
read stays resident while any one of its tensors lives (a norm's few bytes kept a 513 MB file
resident beside the engine's own layouts of it), and copying the views out holds the file twice.
Read here instead, each tensor goes from the file straight into a tensor of its own (`readinto`:
the file's pages pass through the kernel's page cache, not the process), and one converted to
another dtype exists twice only while it converts. The format is safetensors' own: an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
then the data."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


class SafetensorsError(ValueError):
    pass


def read_tensors(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file at `path` by name, floating-point ones in `dtype` (None: as stored)."""
    tensors = {}
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: a header of {length} bytes (at most {MAX_HEADER_BYTES})")
        header = json.loads(file.read(length))
        start = 8 + length
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            stored = DTYPES.get(entry["dtype"])
            if stored is None:
                raise SafetensorsError(f"{path}: tensor {name} has dtype {entry['dtype']} "
                                       f"(read: {', '.join(DTYPES)})")
            begin, end = entry["data_offsets"]
            tensor = torch.empty(entry["shape"], dtype=stored)
            if tensor.nbytes != end - begin:
                raise SafetensorsError(f"{path}: tensor {name} spans {end - begin} bytes, "
                                       f"its shape {entry['shape']} in {entry['dtype']} {tensor.nbytes}")
            file.seek(start + begin)
            if tensor.nbytes and file.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != tensor.nbytes:
                raise SafetensorsError(f"{path}: the file ends inside tensor {name}")
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            tensors[name] = tensor
    return tensors
