"""engine/worker/quantized: a GGUF tensor kept quantized, multiplied by the C loops, against its
dequantized weights (gguf-py's reference) and torch's matmul."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference

from engine.worker import gguf_formats
from engine.worker.quantized import native
from engine.worker.quantized.matrix import CHUNK, QuantizedMatrix, matmul
from tests.test_gguf_formats import T, random_tensor

OUT = 37  # not a multiple of the 8-feature blocks: the padding path too


def matrix_of(qtype, rows: int = OUT, seed: int = 0) -> tuple[QuantizedMatrix, np.ndarray]:
    data = random_tensor(qtype, rows, seed)
    return QuantizedMatrix.of(gguf_formats.unpack(torch.from_numpy(data), qtype), qtype.name), data


def test_the_library_builds_and_loads():
    assert native.library() is not None, native.problem()


@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_rows_are_the_reference_weights(qtype):
    matrix, data = matrix_of(qtype)
    expected = torch.from_numpy(reference(data, qtype))
    assert matrix.nibbles == (qtype in (T.Q4_0, T.Q4_1, T.Q4_K))
    ids = torch.tensor([[5, 0], [36, 8]])
    # Q4_0's reference rounds d x (q - 8), the groups d x q - 8d: one rounding apart.
    tolerance = dict(rtol=1e-6, atol=1e-6) if qtype == T.Q4_0 else dict(rtol=0, atol=0)
    torch.testing.assert_close(matrix.rows(ids), expected[ids], **tolerance)
    torch.testing.assert_close(matrix.dequantize(), expected, **tolerance)


def activation_rounding_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per output, the most that rounding x to int8 per 32 values can move x @ weights.T:
    sum over k of |w| x (the chunk's max |x| / 127) / 2, plus float32 summation's share."""
    dx = x.abs().view(x.shape[0], -1, CHUNK).amax(-1) / 127
    half_step = dx.repeat_interleave(CHUNK, dim=1) / 2
    return half_step @ weights.abs().T + 1e-5 * (x.abs() @ weights.abs().T)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32])
@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_matmul_equals_dequantize_then_matmul(qtype, rows):
    matrix, _ = matrix_of(qtype)
    weights = matrix.dequantize()
    x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(rows))
    ours = matmul(x, [matrix])
    exact = x.double() @ weights.double().T
    assert ours.shape == (rows, OUT)
    bound = activation_rounding_bound(x.double(), weights.double())
    assert ((ours.double() - exact).abs() <= bound).all()
    # and the bound is not loose enough to pass anything: the error is a small part of the output
    assert (ours.double() - exact).norm() < 0.02 * exact.norm()


def test_parts_in_different_formats_side_by_side():
    """A fused projection whose parts are in different formats (Q4_K_M's q/k in Q4_K, v in Q6_K)."""
    first, _ = matrix_of(T.Q4_K, rows=16, seed=1)
    second, _ = matrix_of(T.Q6_K, rows=OUT, seed=2)
    x = torch.randn(3, first.in_features)
    fused = matmul(x, [first, second])
    torch.testing.assert_close(fused, torch.cat([matmul(x, [first]), matmul(x, [second])], dim=1), rtol=0, atol=0)


def test_an_empty_batch_and_a_zero_row():
    matrix, _ = matrix_of(T.Q8_0)
    assert matmul(torch.empty(0, matrix.in_features), [matrix]).shape == (0, OUT)
    assert (matmul(torch.zeros(1, matrix.in_features), [matrix]) == 0).all()
