"""engine/worker/loading/gguf_formats.py against gguf-py's numpy dequantizers (llama.cpp's reference), on
random blocks: random bytes everywhere but the f16 scales, which get sane values."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference

from engine.worker.loading import gguf_formats

T = GGMLQuantizationType
# Byte offsets of each quantized block's f16 fields (d, and dmin/m where the format has one).
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q2_K: (80, 82),
              T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}
GROUP = {T.Q8_0: 32, T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q2_K: 16, T.Q3_K: 16, T.Q4_K: 32, T.Q5_K: 32,
         T.Q6_K: 16, T.IQ4_NL: 32, T.IQ4_XS: 32}
QUANT_RANGE = {T.Q8_0: (-128, 127), T.Q4_0: (0, 15), T.Q4_1: (0, 15), T.Q5_0: (-16, 15), T.Q5_1: (0, 31),
               T.Q2_K: (0, 3), T.Q3_K: (-4, 3), T.Q4_K: (0, 15), T.Q5_K: (0, 31), T.Q6_K: (-32, 31),
               T.IQ4_NL: (-127, 113), T.IQ4_XS: (-127, 113)}
SYMMETRIC = (T.Q8_0, T.Q5_0, T.Q3_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)  # no offset
BLOCKS_PER_ROW = 4
# f16 scales at the format's limits: the largest finite, the smallest normal and subnormal, zeros
EXTREME_SCALES = np.array([65504.0, -65504.0, 6.1035156e-05, -5.9604645e-08, 5.9604645e-08, 0.0, -0.0, 1.0],
                          dtype=np.float16)


def random_tensor(qtype: GGMLQuantizationType, rows: int, seed: int = 0, blocks_per_row: int = BLOCKS_PER_ROW,
                  scales: np.ndarray | None = None) -> np.ndarray:
    """`rows` rows of `blocks_per_row` blocks, shaped as GGUFReader gives the tensor's data: random
    bytes, with each f16 field drawn from `scales` (default: uniform in +-0.05)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    width = blocks_per_row * block_size
    if qtype == T.F32:
        return rng.standard_normal((rows, width), dtype=np.float32)
    if qtype == T.F16:
        return rng.standard_normal((rows, width), dtype=np.float32).astype(np.float16)
    if qtype == T.BF16:  # the high halves of float32s, as bytes (GGUFReader reads BF16 as uint8)
        halves = rng.standard_normal((rows, width), dtype=np.float32).view(np.uint16)[..., 1::2]
        return np.ascontiguousarray(halves).view(np.uint8)
    blocks = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        if scales is None:
            scale = rng.uniform(-0.05, 0.05, rows * blocks_per_row).astype(np.float16)
        else:
            scale = rng.choice(scales, rows * blocks_per_row)
        blocks[:, start:start + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("qtype", gguf_formats.SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference(qtype):
    rows = 100  # 400 blocks
    data = random_tensor(qtype, rows)
    ours = gguf_formats.dequantize(torch.from_numpy(data), qtype)
    expected = reference(data, qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == expected.shape
    np.testing.assert_array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference_at_extreme_scales(qtype):
    """Every f16 factor (d, and dmin or m) one of the largest, smallest or zero values: the same
    products, to the bit, where the float32 results span their widest range."""
    data = random_tensor(qtype, 100, seed=3, scales=EXTREME_SCALES)
    ours = gguf_formats.dequantize(torch.from_numpy(data), qtype)
    expected = reference(data, qtype)
    magnitudes = np.abs(expected[expected != 0])
    assert magnitudes.max() > 4e5 and magnitudes.min() < 1e-6  # both ends reached
    np.testing.assert_array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_unpacked_groups_are_the_weights(qtype):
    rows = 75  # 300 blocks
    data = random_tensor(qtype, rows, seed=1)
    groups = gguf_formats.unpack(torch.from_numpy(data), qtype)
    block_size = GGML_QUANT_SIZES[qtype][0]
    per_row = BLOCKS_PER_ROW * block_size // GROUP[qtype]
    assert groups.group_size == GROUP[qtype]
    assert tuple(groups.quants.shape) == (rows, per_row, GROUP[qtype])
    assert tuple(groups.scale.shape) == (rows, per_row, 1)
    assert (groups.offset is None) == (qtype in SYMMETRIC)
    assert (groups.levels is None) == (qtype not in (T.IQ4_NL, T.IQ4_XS))
    if groups.levels is not None:  # 4-bit indices of the levels
        assert groups.quants.dtype == torch.uint8 and int(groups.quants.max()) == 15
    low, high = QUANT_RANGE[qtype]
    assert int(groups.values.min()) == low and int(groups.values.max()) == high  # random bytes reach both ends
    weights, expected = gguf_formats.affine(groups), torch.from_numpy(reference(data, qtype))
    if qtype == T.Q4_0:  # d*q - 8d against the reference's d*(q - 8): one rounding apart
        torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(weights, expected)


def test_a_row_of_groups_is_a_row_of_weights():
    """Groups follow the weights' row-major order: row 3's groups are row 3's weights."""
    data = random_tensor(T.Q4_K, 8, seed=2)
    groups = gguf_formats.unpack(torch.from_numpy(data), T.Q4_K)
    row = reference(data[3:4], T.Q4_K)[0]
    first = (groups.quants[3, 5].float() * groups.scale[3, 5] + groups.offset[3, 5]).numpy()
    np.testing.assert_array_equal(first, row[5 * 32:6 * 32])


def test_the_iq4_levels_are_ggmls():
    """Each 4-bit index of an IQ4_NL block is the level at that index (ggml's kvalues_iq4nl)."""
    block = np.zeros((1, 18), np.uint8)
    block[0, :2] = np.array([1.0], np.float16).view(np.uint8)
    block[0, 2:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    weights = gguf_formats.dequantize(torch.from_numpy(block), T.IQ4_NL)[0]
    assert weights[:16].tolist() == list(gguf_formats.IQ4_LEVELS)
    assert weights[16:].tolist() == list(gguf_formats.IQ4_LEVELS[::-1])


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ3_S, T.TQ2_0, T.Q8_1])
def test_other_types_are_refused_by_name(qtype):
    data = torch.zeros(4, GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8)
    with pytest.raises(gguf_formats.UnsupportedTensorTypeError, match=qtype.name):
        gguf_formats.dequantize(data, qtype)
    with pytest.raises(gguf_formats.UnsupportedTensorTypeError, match=qtype.name):
        gguf_formats.unpack(data, qtype)
