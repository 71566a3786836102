"""The quantized matmul's C loops (qmatmul.c, qmatmul_batch.c), the decoding sequences' attention
(row_attention.c) and the decoding tokens' layers built on them (native_layers.c), compiled
once per machine into one library and loaded with ctypes.

The library is built with the system's C compiler for this CPU's instructions (`-march=native`)
into its own cache folder (engine/worker/cache_folders.native_folder), named by a
hash of the sources and headers, the compiler and the CPU, in about a second. It links the OpenMP runtime
torch already loaded (libgomp.so.1), so its loops share torch's threads and thread count.
Loading it runs native code in the engine's process, so the packages' rule applies
(engine/worker/package_trust.py): only a library this user's build recorded, in a folder nobody
else can write to, is loaded; and it is called only once its report of the structures Python
fills in matches their ctypes declarations (native_abi.py). `library()` returns None, with
`problem()` saying why, where there is no compiler, the folder is not safe or the layouts differ;
the engine then dequantizes the weights instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path

from engine.worker.cache_folders import native_folder
from engine.worker.package_trust import DIGEST_SUFFIX, digest_path, digest_problem, folder_problem, install
from engine.worker.quantized import native_abi
from engine.worker.quantized.native_abi import Part, Scratch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("qmatmul.c", "qmatmul_batch.c", "row_attention.c", "native_layers.c", "native_abi.c"))
HEADERS = (native_abi.HEADER, Path(__file__).with_name("kernels.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_lock = threading.Lock()
_state: dict[str, object] = {}

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"qlinear": [_P, _I, _I, _I, _I, ctypes.POINTER(Scratch), ctypes.POINTER(Part), _I, _P, _I],
               "layers_step": [_P, _P, _I, _P],
               "rms_norm_rows": [_P, _I, _I, _P, _I, ctypes.c_float, _P],
               "row_attention": [_P, _I, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float]}


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(compiler: str, stem: str = "qmatmul", sources: tuple[Path, ...] = SOURCES,
                 headers: tuple[Path, ...] = HEADERS, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the library `stem` built from `sources` lives: named by them, the compiler and the CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    identity = "\n".join([*(path.read_text() for path in (*sources, *headers)), compiler, version, " ".join(flags), _cpu_flags()])
    return native_folder() / f"{stem}-{hashlib.sha256(identity.encode()).hexdigest()[:20]}.so"


def _finished_build(stem: str) -> re.Pattern:
    """library_path's names and their digest records (not the staging files of a build in progress)."""
    return re.compile(rf"{re.escape(stem)}-[0-9a-f]{{20}}\.so({re.escape(DIGEST_SUFFIX)})?")


def _remove_other_builds(current: Path) -> None:
    """The finished libraries beside `current` other than it, and their digest records, removed:
    each change of the sources, the compiler or the CPU builds a library of its own, and none is
    loaded again once another is built. Another process's build in progress (its staging files)
    is left alone. A process that loaded an old library keeps it mapped; checkouts of different
    sources that share one folder rebuild in turn."""
    keep = {current.name, digest_path(current).name}
    finished = _finished_build(current.name.rsplit("-", 1)[0])
    for path in current.parent.iterdir():
        if path.name not in keep and finished.fullmatch(path.name):
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                log.warning("could not remove an old native build: %s", error)


def _build(compiler: str, out: Path, sources: tuple[Path, ...] = SOURCES, flags: tuple[str, ...] = FLAGS) -> None:
    """`sources` compiled with `flags` into `out` (its digest recorded beside it)."""
    staging = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")
    try:
        result = subprocess.run([compiler, *flags, "-o", str(staging), *map(str, sources), "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {', '.join(p.name for p in sources)}: "
                               f"{result.stderr.strip()[-2000:]}")
        install(staging, out)
    finally:
        staging.unlink(missing_ok=True)


def open_library(path: Path) -> ctypes.CDLL:
    """The library at `path` loaded, its layout of the shared structures checked against
    native_abi.py's (RuntimeError where they differ) before its functions are declared."""
    import torch  # noqa: F401  (its libgomp first: the library binds to the loaded one)

    lib = ctypes.CDLL(str(path))
    problem = native_abi.abi_problem(lib)
    if problem:
        raise RuntimeError(f"{path} disagrees with native_abi.py's declarations, not calling it: {problem}")
    for name, argtypes in _SIGNATURES.items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            raise RuntimeError(f"{path} exports no function {name}") from None
        function.argtypes, function.restype = argtypes, None
    return lib


def built_library(stem: str = "qmatmul", sources: tuple[Path, ...] = SOURCES, headers: tuple[Path, ...] = HEADERS,
                  flags: tuple[str, ...] = FLAGS) -> Path:
    """The library `stem` of `sources`, built first if this machine has none that this user's build
    recorded; RuntimeError where there is no compiler or the folder is not safe."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C compiler (cc or gcc) on PATH to build {stem} with")
    out = library_path(compiler, stem, sources, headers, flags)
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    problem = folder_problem(out.parent)
    if problem:
        raise RuntimeError(f"not building or loading native code there: {problem}")
    if not out.exists() or digest_problem(out) is not None:
        _build(compiler, out, sources, flags)
        log.info("built %s: %s", stem, out)
        _remove_other_builds(out)
    problem = digest_problem(out)
    if problem:
        raise RuntimeError(f"{out}: {problem}")
    return out


def _load() -> ctypes.CDLL:
    return open_library(built_library())


def library() -> ctypes.CDLL | None:
    """The loaded library, built first if needed; None where it cannot be (see `problem`)."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _load()
            except (RuntimeError, OSError, subprocess.SubprocessError) as error:
                _state["lib"], _state["problem"] = None, str(error)
                log.warning("no native quantized matmul: %s", error)
        return _state["lib"]


def problem() -> str | None:
    """Why `library()` is None, or None when it loaded."""
    library()
    return _state.get("problem")
