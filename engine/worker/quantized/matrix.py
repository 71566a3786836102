"""A weight matrix kept in its GGUF quantized form, multiplied natively on a CPU.

`QuantizedMatrix.of(groups)` lays a tensor's groups (engine/worker/loading/gguf_formats.unpack) out as
the C loops in qmatmul.c read them (the layout is described there): quants in blocks of 8 output
features, Q2_K's 2-bit quants four to a byte, Q3_K's in 3 bits (as q + 4), 4-bit formats (Q4_0,
Q4_1, Q4_K) two to a byte, 5-bit ones (Q5_0 as q + 16, Q5_1, Q5_K) in 5 bits and Q6_K's in 6 (as
q + 32), each as 4-bit halves plus a plane of top bits, Q8_0 one to an int8, and the formats' own
scale factors beside them. The IQ4 formats' quants, indices of 16 non-linear int8 levels, are
kept as 4-bit indices with the levels beside them (the loops look them up with a byte shuffle, as
llama.cpp's do). Memory per weight, against the file's:

| type   | kept as             | bits in memory | in the file |
|--------|---------------------|----------------|-------------|
| Q2_K   | 2-bit               | 3.1            | 2.6         |
| Q3_K   | 3-bit               | 3.6            | 3.4         |
| Q4_0   | 4-bit               | 5.0            | 4.5         |
| Q4_1   | 4-bit               | 5.0            | 5.0         |
| Q4_K   | 4-bit               | 4.6            | 4.5         |
| IQ4_NL | 4-bit indices       | 4.5            | 4.5         |
| IQ4_XS | 4-bit indices       | 4.3            | 4.25        |
| Q5_0   | 5-bit               | 5.5            | 5.5         |
| Q5_1   | 5-bit               | 6.0            | 6.0         |
| Q5_K   | 5-bit               | 5.6            | 5.5         |
| Q6_K   | 6-bit               | 6.6            | 6.6         |
| Q8_0   | 8-bit               | 8.5            | 8.5         |

`matmul(x)` quantizes x's rows to int8 per 32 (as llama.cpp does), by default in two levels (the
row, then what rounding left out), and sums each group in integers; the result differs from
`x @ dequantize().T` by the activations' rounding: at most sum |q * scale| * dx / 2 per output
with one level (dx = a chunk's max |x| / 127), 254 times less with two. One level agreed with
the dequantized embedded SmolLM2 on 90.6% of next tokens, two on 100%
(benchmarks/gguf_quality.py). With two levels, a batch of 8 rows or more (native_abi.h's
BATCH_ROWS) goes through qmatmul_batch.c instead: x in int16 per 32 (dx = max |x| / 32767, a
little finer than two int8 levels), 1.15-1.4x faster at 32 rows on a Zen 3; for a K-quant there,
per 128 (dx = max |x| / 16383), so that a span of its products sums in int32 (`int32_span`).
`rows(ids)` dequantizes rows (an embedding lookup).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.worker.quantized import native, native_abi

if TYPE_CHECKING:  # the engine imports this module; the gguf package is needed only to read a file
    from engine.worker.loading.gguf_formats import Groups

# native_abi.h's: output features a block of quants holds; activations quantized per CHUNK values;
# the batch loops' activations share one int16 scale per SPAN_VALUES values (where the rows divide
# into them), rounded to at most X_LIMIT in magnitude
LANES, CHUNK, SPAN_VALUES, X_LIMIT = (native_abi.CONSTANTS[name] for name in ("LANES", "CHUNK", "SPAN_VALUES", "X_LIMIT"))
LEVELS = 2  # the activations' int8 levels by default (and in the native lone step): see the docstring


def int32_span(largest_quant: int, sc: torch.Tensor | None, columns: int, chunks_per_super: int) -> int:
    """How many chunks of 32 products the batch loops may sum in int32 with each group's integer
    factor sc multiplied into the weights (qmatmul_batch.c): the most of 4, 2, 1 whose sum of
    largest |q| * largest |sc| * X_LIMIT cannot overflow, within one super-block (one f16 factor)
    and one span of activations; 0 where the factors stay apart (no sc, or rows that do not divide
    into spans). Q4_K: 4 (15 x 63), Q5_K: 2 (31 x 63), Q6_K: 1 (32 x 128), Q2_K: 4 (3 x 15), Q3_K: 4
    (4 x 32), IQ4_XS: 1 (127 x 32)."""
    if sc is None or columns % SPAN_VALUES or not sc.numel():
        return 0
    largest = largest_quant * int(sc.to(torch.int16).abs().max())
    for span in (SPAN_VALUES // CHUNK, 2, 1):
        if span <= chunks_per_super and span * CHUNK * largest * X_LIMIT < 2**31:
            return span
    return 0


def _lanes(t: torch.Tensor | None, padded: int) -> torch.Tensor | None:
    """(out, n, 1) per-row factors -> (out / LANES, n, LANES), zero rows padded."""
    if t is None:
        return None
    t = t.reshape(t.shape[0], -1)
    t = torch.nn.functional.pad(t, (0, 0, 0, padded - t.shape[0]))
    return t.view(padded // LANES, LANES, -1).transpose(1, 2).contiguous()


@dataclass
class QuantizedMatrix:
    out_features: int
    in_features: int
    quants: torch.Tensor           # see qmatmul.c
    d: torch.Tensor                # f16 (blocks, super-blocks, LANES)
    sc: torch.Tensor | None        # int8 (blocks, groups, LANES)
    dm: torch.Tensor | None
    mn: torch.Tensor | None
    group_size: int
    groups_per_super: int
    bits: int                      # 2, 3, 4, 5, 6 or 8: how the quants are packed
    shift: int = 0                 # 3-, 5- and 6-bit quants are kept as q + shift (0..7, 0..31, 0..63)
    type_name: str = ""
    span: int = 0                  # int32_span's chunks
    table: torch.Tensor | None = None  # int8 (16,): 4-bit quants are indices of these levels

    @classmethod
    def of(cls, groups: Groups, type_name: str = "") -> QuantizedMatrix:
        """From a 2-D tensor's groups: quants (out, groups, group size)."""
        out, num_groups, group = groups.quants.shape
        columns = num_groups * group
        if columns % CHUNK or group not in (16, 32):
            raise ValueError(f"a quantized matrix needs rows of a multiple of {CHUNK} weights in groups "
                             f"of 16 or 32, not {columns} in groups of {group}")
        if groups.groups_per_super & (groups.groups_per_super - 1):
            raise ValueError(f"{groups.groups_per_super} groups a super-block: a power of two is needed")
        padded = -(-out // LANES) * LANES
        blocks, chunks = padded // LANES, columns // CHUNK
        q = torch.nn.functional.pad(groups.quants.reshape(out, columns), (0, 0, 0, padded - out))
        low, high = (int(q.min()), int(q.max())) if q.numel() else (0, 0)
        signed, levels = q.dtype == torch.int8, groups.levels
        largest = max(-low, high) if levels is None else int(levels.to(torch.int16).abs().max())
        if levels is None and not signed and high < 4:  # Q2_K's 0..3
            bits, shift = 2, 0
        elif levels is None and signed and -4 <= low and high < 4:  # Q3_K's -4..3
            bits, shift = 3, 4
        elif levels is not None or (not signed and high < 16):
            bits, shift = 4, 0
        elif -16 <= low and high < (16 if signed else 32):  # Q5_0's -16..15, Q5_1's and Q5_K's 0..31
            bits, shift = 5, 16 if signed else 0
        elif -32 <= low and high < (32 if signed else 64):  # Q6_K's -32..31
            bits, shift = 6, 32 if signed else 0
        else:
            bits, shift = 8, 0
        if bits == 8:
            q = q.view(torch.int8).view(blocks, LANES, chunks, 8, 4).permute(0, 2, 3, 1, 4)
        elif bits in (2, 3):  # k = 8s + 4t + i at bits 2s, 2s + 1 of row t (3 bits: its top bit at bit 2s + t of row 2)
            u = (q.to(torch.int16) + shift).to(torch.uint8).view(blocks, LANES, chunks, 4, 2, 4)  # (.., s, t, i)
            crumbs = u & 3
            rows = crumbs[:, :, :, 0] | (crumbs[:, :, :, 1] << 2) | (crumbs[:, :, :, 2] << 4) | (crumbs[:, :, :, 3] << 6)
            if bits == 3:
                top = (u >> 2).reshape(blocks, LANES, chunks, 8, 4)  # (.., quad 2s + t, i)
                plane = sum(top[:, :, :, quad] << quad for quad in range(8)).to(torch.uint8)
                rows = torch.cat((rows, plane.unsqueeze(3)), dim=3)
            q = rows.permute(0, 2, 3, 1, 4)
        else:
            u = (q.to(torch.int16) + shift).to(torch.uint8).view(blocks, LANES, chunks, CHUNK)
            halves = (u & 15).view(blocks, LANES, chunks, 2, 4, 4)  # (.., low/high half, quad, i)
            q = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
            if bits == 5:  # the top bit of quad T (k = 4T + i) at bit T, one 32-byte row
                top = (u >> 4).view(blocks, LANES, chunks, 8, 4)  # (.., quad, i)
                plane = sum(top[:, :, :, quad] << quad for quad in range(8)).to(torch.uint8)
                q = torch.cat((q, plane.permute(0, 2, 1, 3).unsqueeze(2)), dim=2)
            elif bits == 6:  # the top 2 bits of quad t at bits 2t, 2t + 1, a 32-byte row per half
                top = (u >> 4).view(blocks, LANES, chunks, 2, 4, 4)  # (.., half, quad, i)
                packed = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
                q = torch.cat((q, packed.permute(0, 2, 3, 1, 4)), dim=2)
        span = int32_span(largest, groups.sc, columns, groups.groups_per_super * group // CHUNK)
        return cls(out, columns, q.contiguous(), _lanes(groups.d, padded), _lanes(groups.sc, padded),
                   _lanes(groups.dm, padded), _lanes(groups.mn, padded), group, groups.groups_per_super,
                   bits, shift, type_name, span, None if levels is None else levels.to(torch.int8).contiguous())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.d, self.sc, self.dm, self.mn, self.table)
                   if t is not None)

    def numel(self) -> int:
        return self.out_features * self.in_features

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 weights of rows `ids` (any shape) -> (*ids.shape, in_features)."""
        flat = ids.reshape(-1).long()
        block, lane = flat // LANES, flat % LANES
        q = self.quants[block, :, :, lane]  # (n, chunks, quads, 4)
        if self.bits in (2, 3):
            crumbs = torch.stack([(q[:, :, :2] >> (2 * s)) & 3 for s in range(4)], dim=2)  # (n, chunks, s, t, 4)
            if self.bits == 3:  # the top bit of quad 2s + t
                top = torch.stack([(q[:, :, 2] >> quad) & 1 for quad in range(8)], dim=2).view(crumbs.shape)
                crumbs = (crumbs | (top << 2)).to(torch.int16) - self.shift
            q = crumbs
        elif self.bits != 8:
            nibbles = q[:, :, :4]
            q = torch.stack((nibbles & 15, nibbles >> 4), dim=2)  # (n, chunks, half, quad, 4)
            if self.bits == 5:  # the top bit of quad 4 half + t
                top = torch.stack([(self.quants[block, :, 4, lane] >> quad) & 1 for quad in range(8)], dim=2)
                q = (q | (top.view(q.shape) << 4)).to(torch.int16) - self.shift
            elif self.bits == 6:
                top = torch.stack([(self.quants[block, :, 4:, lane] >> (2 * t)) & 3 for t in range(4)], dim=3)
                q = (q | (top << 4)).to(torch.int16) - self.shift
            elif self.table is not None:
                q = self.table[q.long()]
        q = q.reshape(len(flat), -1, self.group_size).float()
        scale = self._per_group(self.d, self.sc, block, lane)
        weights = q * scale
        if self.dm is not None:
            weights = weights + self._per_group(self.dm, self.mn, block, lane)
        return weights.reshape(*ids.shape, self.in_features)

    def _per_group(self, factor, per_group, block, lane) -> torch.Tensor:
        value = factor[block, :, lane].float().repeat_interleave(self.groups_per_super, dim=1)
        if per_group is not None:
            value = value * per_group[block, :, lane].float()
        return value.unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


def parts(matrices: list[QuantizedMatrix]) -> ctypes.Array:
    """The matrices as the C loops' Part array, their outputs side by side (keep it with the
    matrices: it holds their addresses, not them)."""
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    array, column = (native_abi.Part * len(matrices))(), 0
    for part, m in zip(array, matrices):
        part.q, part.d, part.dm, part.sc, part.mn, part.table = (ptr(m.quants), ptr(m.d), ptr(m.dm), ptr(m.sc),
                                                                 ptr(m.mn), ptr(m.table))
        part.gs, part.sg, part.bits, part.shift, part.blocks, part.column, part.span = (
            m.group_size, m.groups_per_super, m.bits, m.shift, m.quants.shape[0], column, m.span)
        column += m.out_features
    return array


def matmul(x: torch.Tensor, matrices: list[QuantizedMatrix], levels: int = LEVELS, lib=None,
           part_array: ctypes.Array | None = None) -> torch.Tensor:
    """x (rows, in) @ [W1; W2; ...].T as one float32 (rows, sum of out_features): the matrices'
    outputs side by side (a fused q/k/v projection whose parts are in different formats), in
    one native call (x's rows in `levels` int8 levels). `part_array`: `parts(matrices)`, made
    once by a caller that calls often."""
    in_features = matrices[0].in_features
    if any(m.in_features != in_features for m in matrices) or x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} columns, the matrices {[m.in_features for m in matrices]}")
    total = sum(m.out_features for m in matrices)
    rows = x.shape[0]
    out = torch.empty(rows, total + LANES)  # room for the last matrix's padding
    if not rows:
        return out[:, :total]
    lib = lib or native.library()
    if lib is None:
        raise RuntimeError(f"no native quantized matmul: {native.problem()}")
    x = x.float().contiguous()
    scratch = ActivationScratch(levels, rows, in_features)
    array = part_array if part_array is not None else parts(matrices)
    lib.qlinear(x.data_ptr(), rows, in_features, in_features, levels, scratch.struct, array, len(matrices),
                out.data_ptr(), out.stride(0))
    return out[:, :total]


class ActivationScratch:
    """Room for `rows` rows of `in_features` activations quantized in `levels` levels, as the C
    loops lay them out (native_abi.h's Scratch); `struct` is what they take."""

    def __init__(self, levels: int, rows: int, in_features: int) -> None:
        chunks = in_features // CHUNK
        self.xq = torch.empty(levels, rows, in_features, dtype=torch.int8)
        self.dx = torch.empty(levels, rows, chunks)
        self.xsum = torch.empty(rows, chunks, 2)  # the float sums of each 16 values (a group's offset multiplies them)
        self.xqsum = torch.empty(levels, rows, chunks, 2, dtype=torch.int32)
        self.struct = native_abi.Scratch(self.xq.data_ptr(), self.dx.data_ptr(), self.xsum.data_ptr(),
                                         self.xqsum.data_ptr())
