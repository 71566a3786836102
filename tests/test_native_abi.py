"""engine/worker/quantized/native_abi: the structures and constants Python shares with the native
library, checked against the library's own report of them at load, so that a field moved in C or
in ctypes alone refuses the library instead of corrupting memory."""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.worker.package_trust import install
from engine.worker.quantized import native, native_abi
from engine.worker.quantized.matrix import matmul
from tests.test_gguf_formats import T
from tests.test_quantized_matmul import matrix_of


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = native.library()
    assert lib is not None, native.problem()
    return lib


def test_every_ctypes_structure_matches_the_library(lib):
    layouts = native_abi.reported_layout(lib)
    assert sorted(layouts) == sorted(native_abi.STRUCTURES)
    for name, structure in native_abi.STRUCTURES.items():
        assert native_abi.structure_problems(name, structure, layouts[name]) == []
        assert [field for field, *_ in layouts[name].fields] == [field for field, *_ in structure._fields_]
        assert layouts[name].size == ctypes.sizeof(structure)
    assert native_abi.abi_problem(lib) is None


def test_the_library_was_built_with_the_header_constants(lib):
    assert native_abi.reported_constants(lib) == native_abi.CONSTANTS
    assert native_abi.CONSTANTS["LANES"] == 8 and native_abi.CONSTANTS["CHUNK"] == 32


def structure(name: str, fields: list) -> type[ctypes.Structure]:
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def test_ctypes_with_two_fields_swapped_is_refused(lib):
    fields = list(native_abi.Part._fields_)
    fields[0], fields[1] = fields[1], fields[0]  # q, d -> d, q
    problem = native_abi.abi_problem(lib, {**native_abi.STRUCTURES, "Part": structure("Part", fields)})
    assert "Part.q is at offset 0 in the library but 8 in ctypes" in problem
    assert "Part.d is at offset 8 in the library but 0 in ctypes" in problem


def test_a_refused_library_is_no_library_and_the_problem_says_why(lib, monkeypatch):
    fields = list(native_abi.Part._fields_)
    fields[0], fields[1] = fields[1], fields[0]
    monkeypatch.setitem(native_abi.STRUCTURES, "Part", structure("Part", fields))
    monkeypatch.setattr(native, "_state", {})  # as a process that has not loaded it yet
    assert native.library() is None
    assert "disagrees with native_abi.py's declarations" in native.problem()
    assert "Part.q is at offset 0 in the library but 8 in ctypes" in native.problem()


def test_ctypes_with_a_field_missing_is_refused(lib):
    fields = [field for field in native_abi.Step._fields_ if field[0] != "eps"]
    problems = native_abi.structure_problems("Step", structure("Step", fields), native_abi.reported_layout(lib)["Step"])
    assert "Step.eps (offset 48) is in the library's Step but not declared in ctypes" in problems
    assert "Step.scale is at offset 52 in the library but 48 in ctypes" in problems


def test_ctypes_with_a_field_of_another_width_is_refused(lib):
    fields = [("gs", ctypes.c_int32) if name == "gs" else (name, kind) for name, kind in native_abi.Part._fields_]
    problem = native_abi.abi_problem(lib, {"Part": structure("Part", fields)})
    assert "Part.gs is 8 bytes in the library but 4 in ctypes" in problem


def test_a_constant_the_header_and_library_disagree_on_is_refused(lib):
    problem = native_abi.abi_problem(lib, native_abi.STRUCTURES, {**native_abi.CONSTANTS, "LANES": 16})
    assert problem == "LANES is 8 in the library but 16 in native_abi.h"


def layout_library(tmp_path, header_edit=None, table_edit=None, flags=()) -> ctypes.CDLL:
    """Only native_abi.c (the layout report) built with native.py's build function from copies of
    it and native_abi.h, edited, then opened by the loader's function: the kernels are not needed
    to show what the loader refuses, and take far longer to compile."""
    for name, edit in (("native_abi.h", header_edit), ("native_abi.c", table_edit)):
        text = (native.SOURCES[0].parent / name).read_text()
        if edit:
            old, new = edit
            assert old in text
            text = text.replace(old, new)
        (tmp_path / name).write_text(text)
    out = tmp_path / "layout.so"
    native._build(native._compiler(), out, (tmp_path / "native_abi.c",), (*native.FLAGS, *flags))
    return native.open_library(out)


def test_a_field_moved_in_the_c_header_is_refused_at_load(tmp_path):
    moved = ("int64_t block_size, block_stride;\n    int64_t rows;",
             "int64_t rows;\n    int64_t block_size, block_stride;")
    with pytest.raises(RuntimeError) as refused:
        layout_library(tmp_path, header_edit=moved)
    message = str(refused.value)
    assert "disagrees with native_abi.py's declarations" in message
    assert "Step.rows is at offset 56 in the library but 72 in ctypes" in message
    assert "Step.block_size is at offset 64 in the library but 56 in ctypes" in message


def test_a_field_the_c_table_leaves_out_is_refused_at_load(tmp_path):
    with pytest.raises(RuntimeError, match=r"native_abi.c lists no field of Step in bytes 72\.\.80") as refused:
        layout_library(tmp_path, table_edit=("FIELD(Step, rows), ", ""))
    assert "Step.rows is declared in ctypes (offset 72) but the library's Step has no such field" in str(refused.value)


def test_a_library_built_with_another_constant_is_refused_at_load(tmp_path):
    with pytest.raises(RuntimeError, match="BATCH_ROWS is 4 in the library but 8 in native_abi.h"):
        layout_library(tmp_path, flags=("-DBATCH_ROWS=4",))


def test_the_unedited_copies_pass_the_check(tmp_path):
    """The edits above, not the way the copies are built, are what the loader refuses: unedited,
    the layout passes, and the loader goes on to the kernels this small library lacks."""
    with pytest.raises(RuntimeError, match="exports no function qlinear") as refused:
        layout_library(tmp_path)
    assert "disagrees" not in str(refused.value)


# The formats' f16 factors cross as their bits (native_abi.h's half_bits), so that compilers without
# the _Float16 type (GCC before 12 on x86, some clang builds) build the same library.

NO_FLOAT16 = """/* The system headers first (GCC 12's immintrin.h declares its own _Float16 intrinsics), then
   any use of the type is an error, as on a compiler without it. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#pragma GCC poison _Float16
"""


def march_flags(march: str, folder) -> tuple[str, ...]:
    """native.py's flags for `-march=<march>`, every source compiled as without _Float16."""
    (folder / "no_float16.h").write_text(NO_FLOAT16)
    return (*(flag for flag in native.FLAGS if flag != "-march=native"), f"-march={march}",
            "-include", str(folder / "no_float16.h"))


def needs_x86():
    if platform.machine() != "x86_64":
        pytest.skip("the builds for other instruction sets are checked on x86-64")


def test_a_use_of_float16_does_not_build_where_the_type_is_missing(tmp_path):
    """The stand-in for a compiler without _Float16 does refuse the type (else the builds below
    would show nothing)."""
    needs_x86()
    source = tmp_path / "uses_float16.c"
    source.write_text("float first(const _Float16 *p) { return (float)*p; }\n")
    with pytest.raises(RuntimeError, match="poisoned"):
        native._build(native._compiler(), tmp_path / "uses_float16.so", (source,), march_flags("native", tmp_path))


@pytest.fixture(scope="module", params=["native", "x86-64"])
def library_without_float16(request, tmp_path_factory) -> tuple[str, ctypes.CDLL]:
    """The whole library built without _Float16: for this CPU, and for a plain x86-64 (no AVX2, no
    F16C: the one-lane loops, each factor converted from its bits by half_to_float)."""
    needs_x86()
    folder = tmp_path_factory.mktemp(f"no-float16-{request.param}")
    out = folder / "qmatmul.so"
    native._build(native._compiler(), out, native.SOURCES, march_flags(request.param, folder))
    return request.param, native.open_library(out)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)  # f16 scales and offsets; Q6_K's 16-wide groups
def test_the_library_without_float16_computes_the_same(qtype, library_without_float16, lib):
    march, without = library_without_float16
    matrix, _ = matrix_of(qtype)
    for rows in (5, 20) if march == "native" else (5,):  # 20: the batch loops, which a plain x86-64 lacks
        x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(rows))
        ours = matmul(x, [matrix], lib=without)
        if march == "native":  # the same code for this CPU: the same bits
            assert torch.equal(ours, matmul(x, [matrix], lib=lib))
        else:  # the same integer sums, the float products in another order
            reference = x.double() @ matrix.dequantize().double().T
            torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))
            torch.testing.assert_close(ours, matmul(x, [matrix], lib=lib), rtol=1e-4, atol=1e-5 * float(ours.abs().max()))


@pytest.mark.parametrize("march", ["native", "x86-64"])  # F16C's conversion, then the bits' fields
def test_half_to_float_converts_every_half_exactly(march, tmp_path):
    needs_x86()
    source = tmp_path / "halves.c"
    source.write_text('#include "kernels.h"\n'
                      "void halves_to_floats(const uint16_t *in, float *out, int64_t n) {\n"
                      "    for (int64_t i = 0; i < n; i++) out[i] = half_to_float(in[i]);\n}\n")
    out = tmp_path / "halves.so"
    native._build(native._compiler(), out, (source,),
                  (*march_flags(march, tmp_path), f"-I{native.SOURCES[0].parent}"))
    halves = np.arange(2**16, dtype=np.uint16)
    floats = np.empty(2**16, dtype=np.float32)
    ctypes.CDLL(str(out)).halves_to_floats(halves.ctypes.data_as(ctypes.c_void_p),
                                           floats.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(2**16))
    expected = halves.view(np.float16).astype(np.float32)
    number = ~np.isnan(expected)
    assert np.array_equal(np.isnan(floats), ~number)
    assert np.array_equal(floats[number].view(np.uint32), expected[number].view(np.uint32))  # -0.0 and subnormals too


def test_the_wheel_ships_the_c_sources_and_builds_from_them(tmp_path):
    """`pip wheel` (offline, with the environment's setuptools) packs every C source and header
    the library is built from, and an engine imported from the unpacked wheel builds and loads
    it into a native folder of its own."""
    project = Path(__file__).resolve().parents[1]
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info beside the project
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(project / name, source / name)
    for package in ("engine", "kernels", "ui", "storage"):
        shutil.copytree(project / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(tmp_path / "dist")], check=True, cwd=source, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("pagedchat-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(name).name for name in archive.namelist()
                   if name.startswith("engine/worker/quantized/") and name.endswith((".c", ".h"))}
        archive.extractall(tmp_path / "installed")
    assert shipped == {path.name for path in (*native.SOURCES, *native.HEADERS)}
    script = ("from engine.worker.quantized import native\n"
              "lib = native.library()\n"
              "print(native.SOURCES[0].parent, native.library_path(native._compiler()).parent)\n"
              "assert lib is not None, native.problem()\n")
    environment = {**os.environ, "PYTHONPATH": str(tmp_path / "installed"), "PAGEDCHAT_NATIVE_DIR": str(tmp_path / "native")}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(tmp_path / "installed" / "engine" / "worker" / "quantized"), str(tmp_path / "native")]
    assert len(list((tmp_path / "native").glob("qmatmul-*.so"))) == 1


def test_a_new_build_removes_the_older_ones(tmp_path, monkeypatch):
    """After building, the loader removes the folder's other finished builds and their digest
    records, and nothing else: not another process's build in progress, not its own. Loading a
    build that exists removes nothing."""
    # The build itself is the shared folder's library (compiling again would cost ~20 s and test
    # nothing more), installed the way _build installs what the compiler wrote.
    assert native.library() is not None
    built = native.library_path(native._compiler()).read_bytes()
    monkeypatch.setenv("PAGEDCHAT_NATIVE_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    old = tmp_path / "qmatmul-0123456789abcdef0123.so"
    old.write_bytes(b"an older build")
    (tmp_path / f"{old.name}.sha256").write_text(f"0  {old.name}\n")
    orphan_record = tmp_path / "qmatmul-00000000000000000000.so.sha256"
    orphan_record.write_text("0  qmatmul-00000000000000000000.so\n")
    in_progress = [tmp_path / "qmatmul-fedcba9876543210fedc.4242.tmp.so",
                   tmp_path / "qmatmul-fedcba9876543210fedc.so.sha256.4242.tmp", tmp_path / "notes.txt"]
    for path in in_progress:
        path.write_text("another process's")
    def build(compiler, out, *args):
        staging = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")
        staging.write_bytes(built)
        install(staging, out)

    monkeypatch.setattr(native, "_build", build)
    lib = native._load()
    assert native_abi.abi_problem(lib) is None
    current = native.library_path(native._compiler())
    assert sorted(tmp_path.iterdir()) == sorted([current, tmp_path / f"{current.name}.sha256", *in_progress])
    old.write_bytes(b"an older build")
    native._load()  # found, not built
    assert old.exists()
