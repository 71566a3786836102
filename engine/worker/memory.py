"""Where the engine runs and how much KV cache fits: the device, the dtype, the pools' sizes."""
from __future__ import annotations

import torch

GiB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on the CPU, bf16 on a GPU, unless asked otherwise."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def num_device_blocks(device: torch.device, block_bytes: int, gpu_memory_utilization: float,
                      kv_cache_memory_gib: float) -> int:
    """Device pool blocks: on CUDA what `gpu_memory_utilization` of the card leaves once the weights
    and 2 GiB for activations are counted; elsewhere `kv_cache_memory_gib` of main memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * gpu_memory_utilization - (total - free) - 2 * GiB
    else:
        budget = kv_cache_memory_gib * GiB
    blocks = int(budget) // block_bytes
    if blocks < 1:
        raise ValueError(f"no room for the KV cache: a block needs {block_bytes} bytes, budget {int(budget)}")
    return blocks


def num_host_blocks(block_bytes: int, swap_space_gib: float) -> int:
    """Host (swap) pool blocks in `swap_space_gib` of main memory."""
    return int(swap_space_gib * GiB) // block_bytes
