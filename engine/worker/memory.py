"""Where the engine runs and how much KV cache fits: the device, the dtype, the pools' sizes."""
from __future__ import annotations

import torch

GiB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device,
                  model_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype asked for; "auto" (or None), as vLLM's: 16-bit where the device computes it
    natively and the model was published in 16 bits (`model_dtype`, from its config) — bf16 on
    a GPU, and on a CPU with AMX or AVX-512 BF16 — fp32 otherwise (a model stored in fp32, a CPU
    that would emulate bf16 in software and be slower than fp32)."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        sixteen_bit = model_dtype in (torch.bfloat16, torch.float16)
        return torch.bfloat16 if device.type == "cpu" and sixteen_bit and cpu_computes_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def cpu_computes_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 instructions (AMX or AVX-512 BF16), from the kernel's flags."""
    try:
        with open(cpuinfo) as file:
            flags = next((line.split(":", 1)[1].split() for line in file if line.startswith("flags")), [])
    except OSError:  # not Linux: no flags to read, so no claim of native bf16
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


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
