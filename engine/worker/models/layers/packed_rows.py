"""oneDNN's packed layout of a weight read where the engine keeps it: one row times the matrix
(the compiled lone step's matmuls, with no copy of the weights of their own), and a tied model's
embedding looked up in its output head's packed copy (`embedding`).

The batch steps multiply by each weight as oneDNN packed it (linear.py). On the CPUs measured
(AVX-512, with or without BF16) that layout is blocks of 64 output features, each holding every
input: `[N/64][K/2][64][2]` in bf16, `[N/64][K][64]` in fp32 — a layout one row's product streams
in order (packed_rows.c). `rows_of` views a packed weight's memory in that shape and keeps the view
only where it equals the weight element for element; any other layout (another CPU's, a padded
one) gives None, and the lone step lays out a copy of its own (`MatVec`). Linear checks it once,
at load, while the plain weight is still there (`Linear.rows`).

`PackedRows` calls the op `pagedchat::packed_rows` on such a view. torch.export traces it by the
shape declared here; a compiled step calls packed_rows.c's C shim for it directly (`C_SHIM`, the
library loaded process-wide by `load_library` before such a package is); called eagerly, the
same C loop runs through ctypes.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.worker.models.weights import frozen
from engine.worker.quantized import native

BLOCK = 64  # output features a block holds
CHECK_BLOCKS = 16  # blocks compared with the weight at a time
SOURCE = Path(__file__).with_name("packed_rows.c")
C_SHIM = ("AOTITorchError aoti_torch_cpu_packed_rows(AtenTensorHandle x, AtenTensorHandle w, "
          "AtenTensorHandle* ret0)")
_lock = threading.Lock()
_library: list[ctypes.CDLL] = []

torch.library.define("pagedchat::packed_rows", "(Tensor x, Tensor w) -> Tensor")


@torch.library.register_fake("pagedchat::packed_rows")
def _shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((1, w.shape[0] * BLOCK))


@torch.library.impl("pagedchat::packed_rows", "cpu")
def _eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    per = _per(w.dtype)
    if x.shape != (1, w.shape[1] * per) or x.dtype != w.dtype or w.shape[2] != BLOCK * per:
        raise ValueError(f"packed_rows: x {tuple(x.shape)} {x.dtype} does not fit w {tuple(w.shape)} {w.dtype}")
    x, y = x.contiguous(), x.new_empty((1, w.shape[0] * BLOCK))
    load_library().packed_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), w.shape[0], w.shape[1],
                               int(w.dtype == torch.bfloat16))
    return y


def _per(dtype: torch.dtype) -> int:
    """Inputs side by side in a block's row: 2 in bf16, 1 in fp32."""
    return 2 if dtype == torch.bfloat16 else 1


def rows_of(packed: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor | None:
    """`packed` (oneDNN's copy of `weight` [N, K]) viewed as `[N/64, K/per, 64*per]` where it is
    laid out so, element for element; None otherwise. The view aliases `packed`'s memory and keeps
    `packed` alive."""
    if packed is None or packed.layout != torch._mkldnn or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    n, k = weight.shape
    per = _per(weight.dtype)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if n % BLOCK or k % per or nbytes != weight.numel() * weight.element_size():  # padded, or not blocks of 64
        return None
    memory = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    memory.owner = packed  # the view holds this buffer, and so the packed tensor whose memory it is
    rows = torch.frombuffer(memory, dtype=weight.dtype).view(n // BLOCK, k // per, BLOCK * per)
    for first in range(0, n // BLOCK, CHECK_BLOCKS):  # a few blocks at a time: no copy of a whole matrix
        some = rows[first:first + CHECK_BLOCKS]
        as_weight = some.view(some.shape[0], k // per, BLOCK, per).permute(0, 2, 1, 3).reshape(-1, k)
        if not torch.equal(as_weight, weight[first * BLOCK:first * BLOCK + as_weight.shape[0]]):
            return None
    return rows


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of an embedding `table`: a plain `[vocab, hidden]` matrix, or a `rows_of`
    view of one (a tied model's output head, packed, read as its input embedding too: the matrix
    is then held once, not plain beside its packed copy)."""
    if table.dim() == 2:
        return F.embedding(ids, table)
    blocks, depth, width = table.shape
    flat = ids.reshape(-1)
    grouped = table.view(blocks, depth, BLOCK, width // BLOCK)
    picked = grouped[(flat // BLOCK)[:, None], torch.arange(depth, device=ids.device)[None, :], (flat % BLOCK)[:, None]]
    return picked.reshape(*ids.shape, depth * (width // BLOCK))


class PackedRows(torch.nn.Module):
    """One row times the weight `rows` (a `rows_of` view, or a slice of whole blocks of one) holds:
    x `[1, in]` → `[1, out]`, accumulated in fp32 and rounded once to x's dtype."""

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.rows, self.bias = frozen(rows), frozen(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pagedchat.packed_rows(x.contiguous(), self.rows)
        return y if self.bias is None else y + self.bias


def load_library() -> ctypes.CDLL:
    """packed_rows.c built for this machine (engine/worker/quantized/native.py builds it as it does
    the quantized loops) and loaded process-wide, so that a compiled package finds its C shim.
    RuntimeError where it cannot be built or loaded."""
    with _lock:
        if not _library:
            lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
            # The shim calls torch's C API (aoti_torch_*): linked to libtorch_cpu, found where it is.
            flags = (*native.FLAGS, f"-L{lib_dir}", "-Wl,--no-as-needed", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}")
            path = native.built_library("packed_rows", (SOURCE,), (), flags)
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            lib.packed_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
            lib.packed_rows.restype = None
            _library.append(lib)
        return _library[0]
