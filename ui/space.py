"""What running on a Hugging Face Space changes: read from the variables a Space sets.

A Space sets `SPACE_ID` (and, with Gradio's runtime, `SYSTEM=spaces`), who owns it
(`SPACE_AUTHOR_NAME`), and the container's share of the machine: `CPU_CORES` and `MEMORY`
("16Gi" on the free cpu-basic hardware). The share matters because PyTorch sizes its thread
pool from the cores the host has, not from the container's quota: on a 2-vCPU Space it would
start one thread per host core and slow every matmul down by contending for two.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

GiB = 1 << 30
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # downloaded from the hub at start on a Space
KV_SHARE_OF_MEMORY = 8  # at most 1/8 of the container's memory for each KV pool (device and swap)
KV_POOL_GIB = 1.0  # the engine's CPU default for each pool, which a 16 GB Space keeps
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def on_space(env: Mapping[str, str] = os.environ) -> bool:
    return bool(env.get("SPACE_ID"))


@dataclass(frozen=True)
class SpaceHardware:
    """The engine settings for the container a Space runs in; None where the default stands."""
    threads: int | None
    kv_cache_memory_gib: float
    swap_space_gib: float


def space_hardware(env: Mapping[str, str] = os.environ) -> SpaceHardware:
    """Threads from `CPU_CORES`; each KV pool the engine's 1 GiB, or 1/8 of `MEMORY` if that is
    less (the weights, activations and Python need the rest). Unset or unreadable values keep
    the engine's defaults."""
    cores = env.get("CPU_CORES", "").strip()
    threads = int(cores) if cores.isdigit() and int(cores) > 0 else None
    memory = memory_bytes(env.get("MEMORY", ""))
    pool = min(KV_POOL_GIB, memory / KV_SHARE_OF_MEMORY / GiB) if memory else KV_POOL_GIB
    return SpaceHardware(threads, pool, pool)


def memory_bytes(value: str) -> int | None:
    """A Kubernetes-style size in bytes ("16Gi" binary, "16G" decimal, "1073741824"); None if unreadable."""
    match = _SIZE.fullmatch(value.strip())
    if not match:
        return None
    number, unit = float(match.group(1)), (match.group(2) or "")
    if not unit:
        return int(number)
    base = 1024 if unit.lower().endswith("i") else 1000
    return int(number * base ** _POWERS[unit[0].lower()])
