"""GGUF's block formats in torch: the raw bytes of a tensor to its float weights, and (for the
quantized formats) to the integer quants and per-group scales a native matmul reads.

The layouts are llama.cpp's (ggml-common.h); `gguf.quants` (numpy) is the reference each
function here equals, tested on random blocks. Input is what `gguf.GGUFReader` gives for a
tensor, as a torch tensor: whole blocks, shape (..., bytes per row) in uint8 (F32 and F16 come
as float arrays; they are read as their bytes). Output rows have `bytes per row / type size x
block size` weights.

How each quantized format maps onto groups (`unpack`): weight = quant * scale + offset, the
groups in row-major order of the weights:

| type | block | group | quants         | scale           | offset            |
|------|-------|-------|----------------|-----------------|-------------------|
| Q8_0 | 32    | 32    | int8 -128..127 | d (f16)         | none              |
| Q4_0 | 32    | 32    | uint4 0..15    | d (f16)         | -8 d              |
| Q4_1 | 32    | 32    | uint4 0..15    | d (f16)         | m (f16)           |
| Q4_K | 256   | 32    | uint4 0..15    | d x sc (6 bits) | -dmin x m (6 bits)|
| Q5_K | 256   | 32    | uint5 0..31    | d x sc (6 bits) | -dmin x m (6 bits)|
| Q6_K | 256   | 16    | int6 -32..31   | d x sc (int8)   | none              |

So Q4_0, Q4_1 and Q4_K are affine int4 with a scale and an offset per 32 weights (the shape of
torch's CPU int4 weight-only kernels), Q5_K affine int5 per 32, Q8_0 and Q6_K symmetric (no
offset) per 32 and per 16. `dequantize` computes exactly what the reference does, operation for
operation, so its floats are bit-equal to `gguf.quants.dequantize`; `affine(unpack(...))` is
too, except Q4_0, where the reference computes d x (q - 8) and the groups d x q - 8 d (one
rounding apart).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K)
QUANTIZED_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K)


class UnsupportedTensorTypeError(ValueError):
    pass


@dataclass(frozen=True)
class Groups:
    """A quantized tensor as groups: weight = quants * scale + offset, where each group's scale and
    offset are kept as the format's own factors (so a native matmul can keep the file's bits):
    scale = d * sc and offset = dm * mn, with d and dm per super-block of `groups_per_super`
    groups (f16) and sc, mn per group (small integers, int8). A factor that is None is 1 (sc, mn)
    or absent (dm: no offset).

    Shapes: quants (..., groups per row, group size) (uint8, or int8 where the format is signed);
    sc, mn (..., groups per row, 1); d, dm (..., super-blocks per row, 1)."""
    quants: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor | None
    dm: torch.Tensor | None
    mn: torch.Tensor | None

    @property
    def group_size(self) -> int:
        return self.quants.shape[-1]

    @property
    def groups_per_super(self) -> int:
        return self.quants.shape[-2] // self.d.shape[-2]

    @property
    def scale(self) -> torch.Tensor:
        """Per group, float32 (..., groups per row, 1)."""
        return _per_group(self.d, self.sc, self.groups_per_super)

    @property
    def offset(self) -> torch.Tensor | None:
        return None if self.dm is None else _per_group(self.dm, self.mn, self.groups_per_super)


def _per_group(factor: torch.Tensor, per_group: torch.Tensor | None, groups_per_super: int) -> torch.Tensor:
    value = factor.float().repeat_interleave(groups_per_super, dim=-2)
    return value if per_group is None else value * per_group.float()


def check_type(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    """`qtype` as a GGMLQuantizationType, refused with its name unless it is one of ours."""
    try:
        qtype = T(int(qtype))
    except ValueError:
        raise UnsupportedTensorTypeError(f"unknown GGUF tensor type {int(qtype)}") from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorTypeError(
            f"GGUF tensor type {qtype.name} is not supported (supported: "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)})")
    return qtype


def dequantize(data: torch.Tensor, qtype: int | GGMLQuantizationType) -> torch.Tensor:
    """The float32 weights of a GGUF tensor's raw blocks, shape (..., weights per row)."""
    qtype = check_type(qtype)
    raw = _as_bytes(data)
    if qtype == T.F32:
        return raw.view(torch.float32)
    if qtype == T.F16:
        return raw.view(torch.float16).float()
    if qtype == T.BF16:
        return raw.view(torch.bfloat16).float()
    if qtype == T.Q4_0:  # d x (q - 8), as the reference computes it
        groups = unpack(raw, qtype)
        signed = groups.quants.to(torch.int8) - 8
        return (groups.scale * signed.float()).flatten(-2)
    return affine(unpack(raw, qtype))


def affine(groups: Groups) -> torch.Tensor:
    """The float32 weights of `groups`, shape (..., weights per row)."""
    weights = groups.quants.float() * groups.scale
    if groups.offset is not None:
        weights = weights + groups.offset
    return weights.flatten(-2)


def unpack(data: torch.Tensor, qtype: int | GGMLQuantizationType) -> Groups:
    """The integer quants and per-group scale (and offset) factors of a quantized GGUF tensor."""
    qtype = check_type(qtype)
    if qtype not in QUANTIZED_TYPES:
        raise UnsupportedTensorTypeError(f"GGUF tensor type {qtype.name} is not quantized: nothing to unpack")
    raw = _as_bytes(data)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = raw.shape[:-1], raw.shape[-1] // type_size
    quants, d, sc, dm, mn = _UNPACK[qtype](raw.reshape(-1, type_size))
    # (blocks, groups per block, group) -> (..., groups per row, group); factors alike
    groups = blocks_per_row * quants.shape[1]

    def per_row(t: torch.Tensor | None, count: int) -> torch.Tensor | None:
        return None if t is None else t.reshape(*rows, count, -1)

    return Groups(per_row(quants, groups), per_row(d, blocks_per_row), per_row(sc, groups),
                  per_row(dm, blocks_per_row), per_row(mn, groups))


def _as_bytes(data: torch.Tensor) -> torch.Tensor:
    data = data.contiguous()
    return data if data.dtype == torch.uint8 else data.view(torch.uint8)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte `start` of each block, shape (blocks, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16)


def _nibbles(packed: torch.Tensor, span: int) -> torch.Tensor:
    """Runs of `span` bytes hold 2 x `span` 4-bit quants: the low nibbles first, then the high:
    (blocks, runs x span) -> (blocks, 2 x runs, span)."""
    runs = packed.reshape(packed.shape[0], -1, 1, span)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(packed.shape[0], -1, span)


# Each returns (quants (blocks, groups, group), d (blocks, 1), sc (blocks, groups) | None,
# dm (blocks, 1) | None, mn (blocks, groups) | None).

def _q8_0(blocks):
    quants = blocks[:, 2:].contiguous().view(torch.int8)
    return quants.unsqueeze(1), _f16(blocks, 0), None, None, None


def _q4_0(blocks):
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:], 16).reshape(-1, 1, 32), d, None, -8 * d, None  # x8 is exact in f16


def _q4_1(blocks):
    return _nibbles(blocks[:, 4:], 16).reshape(-1, 1, 32), _f16(blocks, 0), None, _f16(blocks, 2), None


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks (ggml's get_scale_min_k4)."""
    packed = packed.reshape(-1, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales.view(torch.int8), mins.view(torch.int8)  # 0..63


def _q4_k(blocks):
    scales, mins = _k_scales(blocks[:, 4:16])
    quants = _nibbles(blocks[:, 16:], 32)  # (blocks, 8, 32)
    return quants, _f16(blocks, 0), scales, -_f16(blocks, 2), mins


_BITS = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)


def _q5_k(blocks):
    scales, mins = _k_scales(blocks[:, 4:16])
    high = (blocks[:, 16:48].unsqueeze(1) >> _BITS) & 0x01  # bit j of byte i: sub-block j, weight i
    quants = _nibbles(blocks[:, 48:], 32) | (high << 4)
    return quants, _f16(blocks, 0), scales, -_f16(blocks, 2), mins


_CRUMBS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)


def _q6_k(blocks):
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMBS) & 0x03).reshape(n, 8, 32)
    quants = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    return quants, _f16(blocks, 208), scales, None, None


_UNPACK = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
