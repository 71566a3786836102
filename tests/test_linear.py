"""The decoder's weight matmul (engine/worker/models/layers/linear.py) equals F.linear on every
path it takes on a CPU: the plain weight for one or two fp32 rows, oneDNN's prepacked copy for
more (and for every bf16 batch), with and without a bias, and an empty batch (a step that only
fills the cache); and the few-row layout is settled by timing both on the weights."""
import time

import pytest
import torch
import torch.nn.functional as F

from engine.worker.models.layers import linear as linear_module
from engine.worker.models.layers.linear import PLAIN_FP32_ROWS, Linear, settle_few_row_path


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("rows", [0, 1, PLAIN_FP32_ROWS, PLAIN_FP32_ROWS + 1, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_batch_size_matches_f_linear(dtype, tolerance, rows, with_bias):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype) if with_bias else None
    x = torch.randn(rows, 64, dtype=dtype)
    y = Linear(weight, bias)(x)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert y.shape == (rows, 96) and y.dtype == dtype
    torch.testing.assert_close(y.float(), expected, atol=tolerance, rtol=tolerance)


def test_bf16_keeps_only_the_packed_copy_and_fp32_both():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("a torch build without oneDNN keeps the plain weight only")
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    bf16, fp32 = Linear(weight), Linear(torch.randn(8, 16))
    if oneDNN_packs_bf16():
        assert bf16.weight is None and bf16.packed is not None
    else:  # a CPU without AVX-512 (or AVX-NE-CONVERT): oneDNN refuses, the plain weight serves
        assert bf16.weight is not None and bf16.packed is None
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(bf16(x), torch.nn.functional.linear(x, weight))
    assert fp32.weight is not None and fp32.packed is not None


def oneDNN_packs_bf16() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16, dtype=torch.bfloat16), 32)
        return True
    except RuntimeError:
        return False


def _slowed(function):
    def slow(*args, **kwargs):
        time.sleep(0.002)
        return function(*args, **kwargs)
    return slow


@pytest.mark.parametrize("slower, kept", [("plain", "packed"), ("packed", "plain")])
def test_the_few_row_layout_is_the_faster_one(monkeypatch, slower, kept):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("a torch build without oneDNN keeps the plain weight only")
    torch.manual_seed(0)
    weights = [(torch.randn(48, 32), torch.randn(48)), (torch.randn(32, 48), None)]
    linears = [Linear(w.clone(), None if b is None else b.clone()) for w, b in weights]
    if slower == "plain":
        monkeypatch.setattr(linear_module.F, "linear", _slowed(F.linear))
    else:
        monkeypatch.setattr(Linear, "packed_matmul", _slowed(Linear.packed_matmul))
    assert settle_few_row_path(linears) == kept
    monkeypatch.undo()
    assert all((linear.weight is None) == (kept == "packed") for linear in linears)
    for rows in (1, PLAIN_FP32_ROWS, PLAIN_FP32_ROWS + 1):  # every batch size still computes the same
        x = torch.randn(rows, 32)
        expected = F.linear(F.linear(x, *weights[0]), *weights[1])
        torch.testing.assert_close(linears[1](linears[0](x)), expected, atol=1e-5, rtol=1e-5)


def test_bf16_has_nothing_to_settle():
    assert settle_few_row_path([Linear(torch.randn(8, 16, dtype=torch.bfloat16))]) == "fixed"
