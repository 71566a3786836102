"""The engine's layers import one way: engine (public surface) -> core / worker -> kernels.

engine/core decides without tensors: none of its modules may import torch, the worker, the
kernels or the public surface, in its own source or through what it imports.
"""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "engine" / "core"


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_core_sources_import_only_the_standard_library_numpy_xxhash_and_core():
    allowed_third_party = {"numpy", "xxhash"}
    for path in sorted(CORE.glob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top == "engine":
                assert name.startswith("engine.core"), f"{path.name} imports {name}: core imports only core"
            else:
                assert top in allowed_third_party or top in sys.stdlib_module_names, \
                    f"{path.name} imports {name}: core is pure Python + numpy"


def test_importing_the_core_and_the_devtools_loads_no_torch():
    code = ("import sys, engine, engine.core.scheduler, engine.core.block_map, engine.devtools.simulate, "
            "engine.devtools.invariants; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'kernels', 'triton') "
            "or m.startswith('engine.worker')); print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "", f"importing the core loaded: {result.stdout.strip()}"


def test_worker_and_kernels_never_import_the_public_surface_or_the_ui():
    for folder in (ROOT / "engine" / "worker", ROOT / "kernels"):
        for path in sorted(folder.rglob("*.py")):
            for name in imported_modules(path):
                top, *rest = name.split(".")
                assert top not in ("ui", "storage", "app"), f"{path} imports {name}"
                if top == "engine":
                    assert rest and rest[0] in ("core", "worker"), f"{path} imports {name}: the worker is below the surface"


def test_ui_and_storage_use_only_the_engine_public_surface():
    for folder in (ROOT / "ui", ROOT / "storage"):
        for path in sorted(folder.rglob("*.py")):
            for name in imported_modules(path):
                if folder.name == "storage":
                    assert name.split(".")[0] != "engine", f"{path} imports {name}: storage knows nothing of the engine"
                else:
                    assert name.split(".")[0] != "engine" or name == "engine", \
                        f"{path} imports {name}: the UI talks to the engine through `from engine import ...`"


def test_engine_top_level_holds_the_public_surface_only():
    modules = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(modules) <= 10, modules
