"""engine/worker/quantized: a GGUF tensor kept quantized, multiplied by the C loops, against its
dequantized weights (gguf-py's reference) and torch's matmul."""
from __future__ import annotations

import dataclasses
import platform
import subprocess

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference

from engine.worker.loading import gguf_formats
from engine.worker.quantized import native, native_abi
from engine.worker.quantized.matrix import CHUNK, SPAN_VALUES, X_LIMIT, QuantizedMatrix, int32_span, matmul
from tests.test_gguf_formats import T, random_tensor

OUT = 37  # not a multiple of the 8-feature blocks: the padding path too
# how each format's quants are packed in memory (matrix.py's table)
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q2_K: 2, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6, T.Q8_0: 8,
        T.IQ4_NL: 4, T.IQ4_XS: 4, T.Q3_K: 3}
TABLED = (T.IQ4_NL, T.IQ4_XS)  # 4-bit indices of 16 int8 values
BATCH_ROWS = native_abi.CONSTANTS["BATCH_ROWS"]  # from this many rows (two levels) the batch loops take a product


def matrix_of(qtype, rows: int = OUT, seed: int = 0) -> tuple[QuantizedMatrix, np.ndarray]:
    data = random_tensor(qtype, rows, seed)
    return QuantizedMatrix.of(gguf_formats.unpack(torch.from_numpy(data), qtype), qtype.name), data


def test_the_library_builds_and_loads():
    assert native.library() is not None, native.problem()


@pytest.mark.parametrize("qtype", gguf_formats.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_rows_are_the_reference_weights(qtype):
    matrix, data = matrix_of(qtype)
    expected = torch.from_numpy(reference(data, qtype))
    assert matrix.bits == BITS[qtype] and (matrix.table is not None) == (qtype in TABLED)
    ids = torch.tensor([[5, 0], [36, 8]])
    # Q4_0's reference rounds d x (q - 8), the groups d x q - 8d: one rounding apart.
    tolerance = dict(rtol=1e-6, atol=1e-6) if qtype == T.Q4_0 else dict(rtol=0, atol=0)
    torch.testing.assert_close(matrix.rows(ids), expected[ids], **tolerance)
    torch.testing.assert_close(matrix.dequantize(), expected, **tolerance)


def activation_rounding_bound(x: torch.Tensor, matrix: QuantizedMatrix, levels: int) -> torch.Tensor:
    """Per output, the most that rounding x can move x @ W.T. A few rows go in as int8 per 32
    values: level 1 within half a step (the chunk's max |x| / 127), level 2 rounds what is left
    (at most half a step) in steps 254 times finer. A batch of BATCH_ROWS rows or more with two
    levels goes in as int16: steps of max |x| / X_LIMIT per SPAN_VALUES values where the matrix
    sums spans in int32, else max |x| / 32767 per 32 (within level 2's). The offsets multiply the
    exact sums of x, so only the scaled quants q * scale see the rounding; plus float32
    summation's share."""
    if levels == 2 and x.shape[0] >= BATCH_ROWS and matrix.span:
        step = x.abs().view(x.shape[0], -1, SPAN_VALUES).amax(-1) / X_LIMIT
        half_step = step.repeat_interleave(SPAN_VALUES, dim=1) / 2
    else:
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


def narrow_groups() -> gguf_formats.Groups:
    """A Q6_K tensor whose quants all lie in -16..15: kept in 5 bits (q + 16), as Q5_0's are, in
    groups of 16, which no 5-bit format has."""
    groups = gguf_formats.unpack(torch.from_numpy(random_tensor(T.Q6_K, OUT)), T.Q6_K)
    return dataclasses.replace(groups, quants=groups.quants.clamp(-16, 15))


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_quants_in_a_narrower_range_are_kept_in_fewer_bits(rows):
    groups = narrow_groups()
    matrix = QuantizedMatrix.of(groups, "Q6_K")
    assert (matrix.bits, matrix.shift, matrix.group_size) == (5, 16, 16)
    weights = (groups.quants.float() * groups.scale).reshape(OUT, -1)
    torch.testing.assert_close(matrix.dequantize(), weights, rtol=0, atol=0)
    x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(rows)).double()
    ours = matmul(x.float(), [matrix]).double()
    assert ((ours - x @ weights.double().T).abs() <= activation_rounding_bound(x, matrix, 2)).all()


def build_library(folder, march: str):
    """The native library built for `-march=<march>` instead of this CPU's own instructions."""
    out = folder / "qmatmul.so"
    flags = [flag for flag in native.FLAGS if flag != "-march=native"] + [f"-march={march}"]
    subprocess.run([native._compiler(), *flags, "-o", str(out), *map(str, native.SOURCES), "-lm"], check=True)
    return native.open_library(out)


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


@pytest.mark.parametrize("rows", [5, 32])
def test_narrower_quants_compute_the_same_on_every_build(rows, portable_library, other_library):
    """narrow_groups' 5-bit quants in groups of 16, on the portable and the other builds."""
    matrix = QuantizedMatrix.of(narrow_groups(), "Q6_K")
    x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(rows))
    fast = matmul(x, [matrix])
    # the portable build has no batch loops: from BATCH_ROWS rows its activations are rounded otherwise
    for lib in (other_library, portable_library) if rows < BATCH_ROWS else (other_library,):
        torch.testing.assert_close(matmul(x, [matrix], lib=lib), fast, rtol=1e-4, atol=1e-5 * float(fast.abs().max()))


@pytest.mark.parametrize("rows", [3, 20, 260])  # 260: the batch loops in three passes over the parts
def test_parts_in_different_formats_side_by_side(rows):
    """A fused projection whose parts are in different formats (Q4_K_M's q/k in Q4_K, v in Q6_K)."""
    first, _ = matrix_of(T.Q4_K, rows=16, seed=1)
    second, _ = matrix_of(T.Q6_K, rows=OUT, seed=2)
    x = torch.randn(rows, first.in_features)
    fused = matmul(x, [first, second])
    torch.testing.assert_close(fused, torch.cat([matmul(x, [first]), matmul(x, [second])], dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("qtype, span", [(T.Q4_K, 4), (T.Q5_K, 2), (T.Q6_K, 1), (T.Q2_K, 4), (T.Q3_K, 4),
                                         (T.IQ4_XS, 1), (T.Q8_0, 0), (T.Q4_1, 0), (T.Q5_0, 0), (T.Q5_1, 0),
                                         (T.IQ4_NL, 0)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_the_int32_span_of_each_format(qtype, span):
    """Random blocks reach each format's largest quants and factors: Q4_K's 15 x 63 sums 4 chunks
    in int32, Q5_K's 31 x 63 two, Q6_K's 32 x 128 one, Q2_K's 3 x 15 and Q3_K's 4 x 32 four,
    IQ4_XS's 127 x 32 one; formats without integer factors none."""
    matrix, _ = matrix_of(qtype)
    assert matrix.span == span
    assert int32_span(15, torch.full((4, 1), 63, dtype=torch.int8), 2 * SPAN_VALUES + CHUNK, 8) == 0  # rows not in spans
    assert int32_span(15, torch.full((4, 1), 63, dtype=torch.int8), 2 * SPAN_VALUES, 2) == 2  # a super-block of 2 chunks


def extreme_matrix(quant: int, sc: int, group: int, columns: int = 2 * 256, levels=None) -> QuantizedMatrix:
    """Every weight at its format's largest |q x sc| (d = 1): a span's int32 sum at its limit.
    With `levels`, quant is the index of a level."""
    signed = quant < 0
    quants = torch.full((OUT, columns // group, group), quant, dtype=torch.int8 if signed else torch.uint8)
    factors = torch.full((OUT, columns // group, 1), sc, dtype=torch.int8)
    d = torch.ones(OUT, columns // 256, 1, dtype=torch.float16)
    levels = None if levels is None else torch.tensor(levels, dtype=torch.int8)
    return QuantizedMatrix.of(gguf_formats.Groups(quants, d, factors, None, None, levels), "extreme")


@pytest.mark.parametrize("quant, sc, group, span, levels", [
    (15, 63, 32, 4, None), (31, 63, 32, 2, None), (-32, -128, 16, 1, None), (3, 15, 16, 4, None),
    (-4, -32, 16, 4, None), (0, -32, 32, 1, gguf_formats.IQ4_LEVELS), (-127, -32, 32, 1, None)],
    ids=["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_XS-as-int8"])
@pytest.mark.parametrize("rows", [1, 32])
def test_the_largest_sums_do_not_overflow(quant, sc, group, span, levels, rows):
    """x at its largest everywhere (every value rounds to X_LIMIT) times the largest weights: the
    spans' int32 sums stay in range and the products equal the float ones."""
    matrix = extreme_matrix(quant, sc, group, levels=levels)
    assert matrix.span == span
    x = torch.full((rows, matrix.in_features), 0.75)
    exact = x.double() @ matrix.dequantize().double().T
    torch.testing.assert_close(matmul(x, [matrix]).double(), exact, rtol=1e-4, atol=0)


def test_an_empty_batch_and_a_zero_row():
    matrix, _ = matrix_of(T.Q8_0)
    assert matmul(torch.empty(0, matrix.in_features), [matrix]).shape == (0, OUT)
    assert (matmul(torch.zeros(1, matrix.in_features), [matrix]) == 0).all()
