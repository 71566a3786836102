"""engine/worker/quantized/native_abi: the structures and constants Python shares with the native
library, checked against the library's own report of them at load, so that a field moved in C or
in ctypes alone refuses the library instead of corrupting memory."""
from __future__ import annotations

import ctypes

import pytest

from engine.worker.quantized import native, native_abi


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
