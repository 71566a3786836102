"""Where the engine keeps what it derives from models and from this machine, under one cache
folder (`PAGEDCHAT_CACHE`, else ~/.cache/pagedchat): converted models, compiled step packages and
the native library, each in a folder of its own so one can be cleared without the others."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDCHAT_CACHE", Path.home() / ".cache" / "pagedchat"))


def packages_folder() -> Path:
    """The compiled steps' packages (engine/worker/compiled/)."""
    return Path(os.environ.get("PAGEDCHAT_COMPILED_DIR") or cache_dir() / "compiled")


def native_folder() -> Path:
    """The native library built from engine/worker/quantized's C sources."""
    return Path(os.environ.get("PAGEDCHAT_NATIVE_DIR") or cache_dir() / "native")
