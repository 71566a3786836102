"""engine/worker/quantized: a GGUF tensor kept quantized, multiplied by the C loops, against its
dequantized weights (gguf-py's reference) and torch's matmul."""
from __future__ import annotations

import ctypes
import dataclasses
import platform
import subprocess

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
    assert matrix.bits == (4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 6 if qtype in (T.Q5_K, T.Q6_K) else 8)
    ids = torch.tensor([[5, 0], [36, 8]])
    # Q4_0's reference rounds d x (q - 8), the groups d x q - 8d: one rounding apart.
    tolerance = dict(rtol=1e-6, atol=1e-6) if qtype == T.Q4_0 else dict(rtol=0, atol=0)
    torch.testing.assert_close(matrix.rows(ids), expected[ids], **tolerance)
    torch.testing.assert_close(matrix.dequantize(), expected, **tolerance)


def activation_rounding_bound(x: torch.Tensor, matrix: QuantizedMatrix, levels: int) -> torch.Tensor:
    """Per output, the most that rounding x to int8 per 32 values can move x @ W.T. Level 1 is
    within half a step (the chunk's max |x| / 127), level 2 rounds what is left (at most half a
    step) in steps 254 times finer. The offsets multiply the exact sums of x, so only the scaled
    quants q * scale see the rounding; plus float32 summation's share. (A batch of BATCH_ROWS rows
    or more goes in as int16 with two levels, in steps 258 times finer than level 1's: within.)"""
    step = x.abs().view(x.shape[0], -1, CHUNK).amax(-1) / 127 / (1 if levels == 1 else 254)
    half_step = step.repeat_interleave(CHUNK, dim=1) / 2
    scaled = dataclasses.replace(matrix, dm=None, mn=None).dequantize().double().abs()
    weights = matrix.dequantize().double().abs()
    return half_step @ scaled.T + 1e-5 * (x.abs() @ weights.T)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 32, 300])  # from 8: the batch loops (8: 2 tiles of 3 and one of 2); 300: three passes of 100
@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_matmul_equals_dequantize_then_matmul(qtype, rows, levels):
    matrix, _ = matrix_of(qtype)
    x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(rows)).double()
    ours = matmul(x.float(), [matrix], levels).double()
    exact = x @ matrix.dequantize().double().T
    assert ours.shape == (rows, OUT)
    assert ((ours - exact).abs() <= activation_rounding_bound(x, matrix, levels)).all()
    # and the bound is not loose enough to pass anything: the error is a small part of the output
    assert (ours - exact).norm() < (0.02 if levels == 1 else 1e-4) * exact.norm()


def build_library(folder, march: str):
    """The native library built for `-march=<march>` instead of this CPU's own instructions."""
    out = folder / "qmatmul.so"
    flags = [flag for flag in native.FLAGS if flag != "-march=native"] + [f"-march={march}"]
    subprocess.run([native._compiler(), *flags, "-o", str(out), *map(str, native.SOURCES), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    for name, argtypes in native._SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, None
    return lib


@pytest.fixture(scope="module")
def portable_library(tmp_path_factory):
    """qmatmul.c built for a plain x86-64 (no AVX2): its one-lane-at-a-time spelling."""
    if platform.machine() != "x86_64":
        pytest.skip("the portable build is checked on x86-64")
    return build_library(tmp_path_factory.mktemp("portable"), "x86-64")


# Builds for other instruction sets this CPU can also run, each held to the native build's results:
# AVX2 alone (x86-64-v3: the batch loops' 256-bit tiles, which an AVX-512 build leaves out), and
# AVX-512 VNNI without VBMI (Cascade Lake: the 512-bit tiles with the AVX2 unpacking).
OTHER_BUILDS = {"x86-64-v3": ("avx2", "fma", "f16c"), "cascadelake": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")}


@pytest.fixture(scope="module", params=sorted(OTHER_BUILDS))
def other_library(request, tmp_path_factory):
    flags = native._cpu_flags().split()
    missing = [flag for flag in OTHER_BUILDS[request.param] if flag not in flags]
    if platform.machine() != "x86_64" or missing:
        pytest.skip(f"the {request.param} build needs {', '.join(missing) or 'x86-64'}")
    return build_library(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_the_portable_spelling_computes_the_same(qtype, levels, portable_library):
    matrix, _ = matrix_of(qtype)
    x = torch.randn(5, matrix.in_features, generator=torch.Generator().manual_seed(7))
    fast = matmul(x, [matrix], levels)
    # the same integer sums, the float products taken in another order
    torch.testing.assert_close(matmul(x, [matrix], levels, lib=portable_library), fast,
                               rtol=1e-4, atol=1e-5 * float(fast.abs().max()))


@pytest.mark.parametrize("out", [OUT, 56])  # 56: 7 blocks, a unit of 4 then 2 and 1
@pytest.mark.parametrize("rows", [5, 32, 260])
@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_other_instruction_sets_compute_the_same(qtype, rows, out, other_library):
    """Whichever loops this CPU's build takes, the other builds' agree with them: the same integer
    sums of each group, scaled and added in another order."""
    matrix, _ = matrix_of(qtype, rows=out)
    x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(rows))
    fast = matmul(x, [matrix])
    torch.testing.assert_close(matmul(x, [matrix], lib=other_library), fast, rtol=1e-4, atol=1e-5 * float(fast.abs().max()))


@pytest.mark.parametrize("rows", [3, 20, 260])  # 260: the batch loops in three passes over the parts
def test_parts_in_different_formats_side_by_side(rows):
    """A fused projection whose parts are in different formats (Q4_K_M's q/k in Q4_K, v in Q6_K)."""
    first, _ = matrix_of(T.Q4_K, rows=16, seed=1)
    second, _ = matrix_of(T.Q6_K, rows=OUT, seed=2)
    x = torch.randn(rows, first.in_features)
    fused = matmul(x, [first, second])
    torch.testing.assert_close(fused, torch.cat([matmul(x, [first]), matmul(x, [second])], dim=1), rtol=0, atol=0)


def test_an_empty_batch_and_a_zero_row():
    matrix, _ = matrix_of(T.Q8_0)
    assert matmul(torch.empty(0, matrix.in_features), [matrix]).shape == (0, OUT)
    assert (matmul(torch.zeros(1, matrix.in_features), [matrix]) == 0).all()
