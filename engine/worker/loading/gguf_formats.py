"""GGUF's block formats in torch: the raw bytes of a tensor to its float weights, and (for the
quantized formats) to the integer quants and per-group scales a native matmul reads.

The layouts are llama.cpp's (ggml-common.h); `gguf.quants` (numpy) is the reference each
function here equals, tested on random blocks. Input is what `gguf.GGUFReader` gives for a
tensor, as a torch tensor: whole blocks, shape (..., bytes per row) in uint8 (F32 and F16 come
as float arrays; they are read as their bytes). Output rows have `bytes per row / type size x
block size` weights.

How each quantized format maps onto groups (`unpack`): weight = quant * scale + offset, the
groups in row-major order of the weights:

| type   | block | group | quants            | scale             | offset             |
|--------|-------|-------|-------------------|-------------------|--------------------|
| Q8_0   | 32    | 32    | int8 -128..127    | d (f16)           | none               |
| Q4_0   | 32    | 32    | uint4 0..15       | d (f16)           | -8 d               |
| Q4_1   | 32    | 32    | uint4 0..15       | d (f16)           | m (f16)            |
| Q5_0   | 32    | 32    | int5 -16..15      | d (f16)           | none               |
| Q5_1   | 32    | 32    | uint5 0..31       | d (f16)           | m (f16)            |
| Q2_K   | 256   | 16    | uint2 0..3        | d x sc (4 bits)   | -dmin x m (4 bits) |
| Q3_K   | 256   | 16    | int3 -4..3        | d x sc (int6)     | none               |
| Q4_K   | 256   | 32    | uint4 0..15       | d x sc (6 bits)   | -dmin x m (6 bits) |
| Q5_K   | 256   | 32    | uint5 0..31       | d x sc (6 bits)   | -dmin x m (6 bits) |
| Q6_K   | 256   | 16    | int6 -32..31      | d x sc (int8)     | none               |
| IQ4_NL | 32    | 32    | uint4 -> levels   | d (f16)           | none               |
| IQ4_XS | 256   | 32    | uint4 -> levels   | d x sc (int6)     | none               |

So Q4_0, Q4_1 and Q4_K are affine int4 with a scale and an offset per 32 weights (the shape of
torch's CPU int4 weight-only kernels), Q5_1 and Q5_K affine int5 per 32, Q2_K affine int2 per 16,
Q8_0 and Q5_0 symmetric (no offset) per 32, Q3_K and Q6_K symmetric per 16. The IQ4 formats' quants
are 4-bit indices of 16 non-linear int8 levels (ggml's kvalues, `IQ4_LEVELS`, the groups'
`levels`): a group is d (x sc) times those int8 values, symmetric per 32. `dequantize` computes exactly
what the reference does, operation for operation, so its floats are bit-equal to
`gguf.quants.dequantize`; `affine(unpack(...))` is too, except Q4_0, where the reference computes
d x (q - 8) and the groups d x q - 8 d (one rounding apart).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QUANTIZED_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                   T.IQ4_NL, T.IQ4_XS)
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, *QUANTIZED_TYPES)
# IQ4_NL's and IQ4_XS's 16 non-linear levels, a 4-bit index each (ggml-common.h's kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class UnsupportedTensorTypeError(ValueError):
    pass


@dataclass(frozen=True)
class Groups:
    """A quantized tensor as groups: weight = quants * scale + offset, where each group's scale and
    offset are kept as the format's own factors (so a native matmul can keep the file's bits):
    scale = d * sc and offset = dm * mn, with d and dm per super-block of `groups_per_super`
    groups (f16) and sc, mn per group (small integers, int8). A factor that is None is 1 (sc, mn)
    or absent (dm: no offset). Where `levels` is given (int8, 16 of them: IQ4's), the quants are
    indices of it, and a weight's integer is the level: weight = levels[quant] * scale + offset.

    Shapes: quants (..., groups per row, group size) (uint8, or int8 where the format is signed);
    sc, mn (..., groups per row, 1); d, dm (..., super-blocks per row, 1)."""
    quants: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor | None
    dm: torch.Tensor | None
    mn: torch.Tensor | None
    levels: torch.Tensor | None = None

    @property
    def values(self) -> torch.Tensor:
        """Each weight's integer: the quant, or the level it indexes."""
        return self.quants if self.levels is None else self.levels[self.quants.long()]

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
    weights = groups.values.float() * groups.scale
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
                  per_row(dm, blocks_per_row), per_row(mn, groups), _LEVELS if qtype in (T.IQ4_NL, T.IQ4_XS) else None)


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


_BITS = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4 bytes of high bits, a little-endian uint32 whose bit i is weight i's: (blocks, 32)."""
    return ((qh.unsqueeze(-1) >> _BITS) & 0x01).reshape(qh.shape[0], 32)


def _q5_0(blocks):
    quants = _nibbles(blocks[:, 6:], 16).reshape(-1, 32) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return (quants.view(torch.int8) - 16).reshape(-1, 1, 32), _f16(blocks, 0), None, None, None


def _q5_1(blocks):
    quants = _nibbles(blocks[:, 8:], 16).reshape(-1, 32) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return quants.reshape(-1, 1, 32), _f16(blocks, 0), None, _f16(blocks, 2), None


_CRUMBS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)


def _crumbs(packed: torch.Tensor) -> torch.Tensor:
    """Runs of 32 bytes hold 4 x 32 2-bit quants, bits 2s, 2s + 1 of byte j being weight 32s + j
    of the run: (blocks, runs x 32) -> (blocks, runs x 128)."""
    runs = packed.reshape(packed.shape[0], -1, 1, 32)
    return ((runs >> _CRUMBS) & 0x03).reshape(packed.shape[0], -1)


def _q2_k(blocks):
    factors = blocks[:, :16]
    quants = _crumbs(blocks[:, 16:80]).reshape(-1, 16, 16)
    return quants, _f16(blocks, 80), (factors & 0x0F).view(torch.int8), -_f16(blocks, 82), (factors >> 4).view(torch.int8)


def _q3_k(blocks):
    n = blocks.shape[0]
    # bit b of hmask byte j is weight 32b + j's; a weight whose bit is clear is 4 lower
    high = ((blocks[:, :32].unsqueeze(1) >> _BITS.reshape(1, 8, 1)) & 0x01).reshape(n, 256)
    quants = (_crumbs(blocks[:, 32:96]).view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)).reshape(n, 16, 16)
    packed = blocks[:, 96:108]
    low = torch.cat((packed[:, :8] & 0x0F, packed[:, :8] >> 4), dim=1)  # scale j: nibble of byte j % 8
    top = (packed[:, 8:12].unsqueeze(1) >> _CRUMBS.reshape(1, 4, 1)) & 0x03  # scale j: byte 8 + j % 4, bits 2 (j / 4)
    scales = (low | (top.reshape(n, 16) << 4)).view(torch.int8) - 32
    return quants, _f16(blocks, 108), scales, None, None


_LEVELS = torch.tensor(IQ4_LEVELS, dtype=torch.int8)


def _iq4_nl(blocks):  # the indices of _LEVELS
    return _nibbles(blocks[:, 2:], 16).reshape(-1, 1, 32), _f16(blocks, 0), None, None, None


def _iq4_xs(blocks):
    n = blocks.shape[0]
    high = blocks[:, 2].to(torch.int32) | (blocks[:, 3].to(torch.int32) << 8)  # scale j's top 2 bits at 2j
    top = (high.unsqueeze(1) >> (2 * torch.arange(8, dtype=torch.int32))) & 0x03
    low = torch.stack((blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4), dim=2).reshape(n, 8)
    scales = (low | (top.to(torch.uint8) << 4)).view(torch.int8) - 32
    return _nibbles(blocks[:, 8:], 16).reshape(n, 8, 32), _f16(blocks, 0), scales, None, None


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


def _q5_k(blocks):
    scales, mins = _k_scales(blocks[:, 4:16])
    high = (blocks[:, 16:48].unsqueeze(1) >> _BITS.reshape(1, 8, 1)) & 0x01  # bit j of byte i: sub-block j, weight i
    quants = _nibbles(blocks[:, 48:], 32) | (high << 4)
    return quants, _f16(blocks, 0), scales, -_f16(blocks, 2), mins


def _q6_k(blocks):
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMBS) & 0x03).reshape(n, 8, 32)
    quants = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    return quants, _f16(blocks, 208), scales, None, None


_UNPACK = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q2_K: _q2_k, T.Q3_K: _q3_k,
           T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs}
