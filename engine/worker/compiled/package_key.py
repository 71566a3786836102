"""Where a compiled step's package lives: keyed by the model's weights, the dtype, torch, the CPU's
vector instructions and the code its graph is traced from, so that any change to them builds a new
one rather than loading one that no longer fits."""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch

from engine.worker.cache_folders import packages_folder
from engine.worker.compiled.shapes import MAX_CONTEXT
from engine.worker.compiled.vector_isa import vector_isa
from engine.worker.loading.model_files import resolve_model
from engine.worker.models.layers.linear import packed_for_onednn

# What a package's graph is traced from: a change to any of these files rebuilds the packages.
_LAYERS = tuple(f"engine/worker/models/layers/{name}.py"
                for name in ("activation", "attention", "rms_norm", "rotary", "shape"))

_SOURCES = {"lone": ("engine/worker/compiled/export.py", "engine/worker/compiled/shapes.py", "engine/worker/compiled/lone_step.py",
                     "engine/worker/models/weights.py", "engine/worker/models/layers/matvec.py",
                     "engine/worker/models/layers/packed_rows.py", *_LAYERS),
            "flat": ("engine/worker/compiled/export.py", "engine/worker/compiled/shapes.py", "engine/worker/compiled/flat_step.py",
                     "engine/worker/models/weights.py", "engine/worker/models/layers/linear.py",
                     "engine/worker/models/layers/packed_rows.py", *_LAYERS)}

_PREFIX = {"lone": "decode", "flat": "flat-step"}


PROBE_SIZE = 16  # a matrix this small tells whether oneDNN packs the dtype here


def package_path(model: str | None, dtype: torch.dtype, kind: str = "lone") -> Path:
    """Where the `kind` package for `model` in `dtype` on this machine lives."""
    root = Path(__file__).resolve().parents[3]
    folder = Path(resolve_model(model))
    name = folder.name
    identity = {"model": str(folder), "dtype": str(dtype), "torch": torch.__version__, "isa": vector_isa(),
                "max_context": MAX_CONTEXT,
                # the flat graph is traced for packed or plain matrices: whichever oneDNN does here
                "packed": packed_for_onednn(torch.zeros(PROBE_SIZE, PROBE_SIZE, dtype=dtype)) is not None,
                "kind": kind, "code": [hashlib.sha256((root / name).read_bytes()).hexdigest() for name in _SOURCES[kind]]}
    if not folder.is_dir():  # a hub id: the revision the engine loaded is the cached snapshot's
        with contextlib.suppress(Exception):
            from huggingface_hub import try_to_load_from_cache
            config = try_to_load_from_cache(str(identity["model"]), "config.json")
            if isinstance(config, str):
                folder = Path(config).parent  # .../snapshots/<commit>
    if folder.is_dir():
        identity["snapshot"] = str(folder)
        identity["config"] = (folder / "config.json").read_text()
        identity["weights"] = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                     for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return packages_folder() / f"{_PREFIX[kind]}-{name}-{str(dtype).removeprefix('torch.')}-{key}.pt2"


def staging_path(out: Path, pid: int) -> Path:
    """Where build process `pid` writes the package `out` before installing it."""
    return out.with_name(f"{out.stem}.{pid}.tmp.pt2")


def retired_packages(folder: Path) -> list[Path]:
    """Packages of kinds no longer built (an older engine's), which nothing will load again."""
    current = tuple(f"{prefix}-" for prefix in _PREFIX.values())
    return [path for path in folder.glob("*.pt2") if not path.name.startswith(current) and ".tmp." not in path.name]
