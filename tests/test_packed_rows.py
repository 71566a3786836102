"""One row times a weight in oneDNN's packed layout, read in place
(engine/worker/models/layers/packed_rows.py, packed_rows.c): the view is the weight element for
element or there is none, and the C loop's product equals the weight's matmul within rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.worker.models.layers.linear import packed_for_onednn
from engine.worker.models.layers.packed_rows import BLOCK, PackedRows, embedding, rows_of

SHAPES = [(64, 64), (192, 576), (576, 1536), (1024, 96)]


def packed_or_skip(weight: torch.Tensor) -> torch.Tensor:
    packed = packed_for_onednn(weight)
    if packed is None:
        pytest.skip(f"oneDNN does not pack {weight.dtype} on this CPU")
    rows = rows_of(packed, weight)
    if rows is None:
        pytest.skip(f"oneDNN lays {weight.dtype} out otherwise on this CPU: the lone step keeps its own copy")
    return packed


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_a_row_times_the_packed_weight_equals_its_matmul(dtype, tolerance, out_features, in_features):
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = packed_or_skip(weight)
    rows = rows_of(packed, weight)
    assert rows.shape[0] == out_features // BLOCK and rows.data_ptr() == torch.ops.mkldnn.data_ptr(packed)
    x, bias = torch.randn(1, in_features).to(dtype), torch.randn(out_features).to(dtype)
    expected = F.linear(x.float(), weight.float(), bias.float())
    got = PackedRows(rows, bias)(x)
    assert got.dtype == dtype and got.shape == (1, out_features)
    assert (got.float() - expected).abs().max() <= tolerance * expected.abs().max()
    # whole blocks of it, as the lone step splits q from k/v: the same rows of the product
    half = (out_features // BLOCK // 2) * BLOCK
    if half:
        assert torch.equal(PackedRows(rows[half // BLOCK:])(x), PackedRows(rows)(x)[:, half:])


def test_only_a_layout_equal_to_the_weight_is_read_in_place():
    weight = torch.randn(128, 64)
    packed = packed_or_skip(weight)
    assert rows_of(packed, weight + 1) is None  # not the weight this copy was packed from
    assert rows_of(None, weight) is None and rows_of(weight, weight) is None  # nothing packed; a plain tensor
    odd = torch.randn(100, 70)  # oneDNN pads it to whole blocks: not read in place
    assert rows_of(packed_for_onednn(odd), odd) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_head_gives_the_embeddings_rows(dtype):
    """A tied model's input embedding read from its output head's packed copy: the same rows,
    bit for bit, for any ids (a block's first and last, the vocabulary's last, a batch's shape)."""
    weight = torch.randn(8 * BLOCK, 96).to(dtype)
    rows = rows_of(packed_or_skip(weight), weight)
    ids = torch.tensor([[0, 1, BLOCK - 1, BLOCK], [3 * BLOCK + 7, 8 * BLOCK - 1, 5, 0]])
    assert torch.equal(embedding(ids, rows), weight[ids])
    assert torch.equal(embedding(ids[0, :1], rows), weight[:1])
    assert torch.equal(embedding(ids, weight), weight[ids])  # a plain matrix: torch's own lookup


def test_a_tied_model_holds_its_head_once(tiny_model_dir):
    """The tiny tied model: its embedding is its head's packed memory, read as the plain matrix."""
    from engine.worker.loading.checkpoint import read_folder
    from engine.worker.models.llama import LlamaModel

    decoder = LlamaModel(read_folder(tiny_model_dir, torch.bfloat16), torch.bfloat16, torch.device("cpu"))
    if decoder.embed.dim() == 2:
        pytest.skip("oneDNN does not pack bf16 as blocks of 64 here: the embedding stays plain")
    packed = decoder.lm_head.packed
    start = torch.ops.mkldnn.data_ptr(packed)
    assert start <= decoder.embed.data_ptr() < start + torch.ops.mkldnn._nbytes(packed)
    plain = packed.to_dense()
    ids = torch.tensor([0, 17, 4000, plain.shape[0] - 1])
    assert torch.equal(embedding(ids, decoder.embed), plain[ids])


def test_a_row_that_does_not_fit_is_refused():
    weight = torch.randn(64, 64)
    packed = packed_or_skip(weight)
    with pytest.raises(ValueError, match="does not fit"):
        PackedRows(rows_of(packed, weight))(torch.randn(1, 32))


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "cascadelake"])
def test_every_instruction_set_build_gives_the_same_product(march, tmp_path):
    """The loop without AVX-512 BF16 (bf16 pairs split by shifts, in whatever vectors the build has)
    against the one this machine loads."""
    import ctypes
    import os
    import platform

    from engine.worker.models.layers import packed_rows
    from engine.worker.quantized import native

    if platform.machine() != "x86_64":
        pytest.skip("the builds for other instruction sets are checked on x86-64")
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    flags = (*(flag for flag in native.FLAGS if flag != "-march=native"), f"-march={march}",
             f"-L{lib_dir}", "-Wl,--no-as-needed", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}")
    out = tmp_path / f"packed_rows_{march}.so"
    native._build(native._compiler(), out, (packed_rows.SOURCE,), flags)
    built = ctypes.CDLL(str(out))
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(192, 576).to(dtype)
        packed = packed_for_onednn(weight)
        rows = None if packed is None else rows_of(packed, weight)
        if rows is None:
            continue
        x, y = torch.randn(1, 576).to(dtype), torch.empty(1, 192, dtype=dtype)
        built.packed_rows(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(rows.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                          ctypes.c_int64(rows.shape[0]), ctypes.c_int64(rows.shape[1]), ctypes.c_int(dtype == torch.bfloat16))
        expected = PackedRows(rows)(x)
        assert (y.float() - expected.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 1e-2) * expected.float().abs().max()
