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
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
GROUP = {T.Q8_0: 32, T.Q4_0: 32, T.Q4_1: 32, T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 16}
QUANT_RANGE = {T.Q8_0: (-128, 127), T.Q4_0: (0, 15), T.Q4_1: (0, 15), T.Q4_K: (0, 15), T.Q5_K: (0, 31),
               T.Q6_K: (-32, 31)}
BLOCKS_PER_ROW = 4


def random_tensor(qtype: GGMLQuantizationType, rows: int, seed: int = 0) -> np.ndarray:
    """`rows` rows of BLOCKS_PER_ROW blocks, shaped as GGUFReader gives the tensor's data."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    width = BLOCKS_PER_ROW * block_size
    if qtype == T.F32:
        return rng.standard_normal((rows, width), dtype=np.float32)
    if qtype == T.F16:
        return rng.standard_normal((rows, width), dtype=np.float32).astype(np.float16)
    if qtype == T.BF16:  # the high halves of float32s, as bytes (GGUFReader reads BF16 as uint8)
        halves = rng.standard_normal((rows, width), dtype=np.float32).view(np.uint16)[..., 1::2]
        return np.ascontiguousarray(halves).view(np.uint8)
    blocks = rng.integers(0, 256, (rows * BLOCKS_PER_ROW, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, rows * BLOCKS_PER_ROW).astype(np.float16)
        blocks[:, start:start + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, BLOCKS_PER_ROW * type_size)


@pytest.mark.parametrize("qtype", gguf_formats.SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference(qtype):
    rows = 100  # 400 blocks
    data = random_tensor(qtype, rows)
    ours = gguf_formats.dequantize(torch.from_numpy(data), qtype)
    expected = reference(data, qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == expected.shape
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
    assert (groups.offset is None) == (qtype in (T.Q8_0, T.Q6_K))
    low, high = QUANT_RANGE[qtype]
    assert int(groups.quants.min()) >= low and int(groups.quants.max()) <= high
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


@pytest.mark.parametrize("qtype", [T.Q5_0, T.IQ4_NL, T.Q2_K])
def test_other_types_are_refused_by_name(qtype):
    data = torch.zeros(4, GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8)
    with pytest.raises(gguf_formats.UnsupportedTensorTypeError, match=qtype.name):
        gguf_formats.dequantize(data, qtype)
    with pytest.raises(gguf_formats.UnsupportedTensorTypeError, match=qtype.name):
        gguf_formats.unpack(data, qtype)
