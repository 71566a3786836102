"""What the benchmarks measure with: device-synchronised clocks, the device's name, its matmul
roofline, and how much of the machine other processes took meanwhile."""
from __future__ import annotations

import gc
import os
import time

import torch
from benchmarks.machine import cpu_model


def now(device: torch.device) -> float:
    """perf_counter after everything queued on the device has finished (a no-op wait on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def free_memory(device: torch.device) -> None:
    """Collect what the last system left (cycles included) and, on CUDA, return the cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def measure_matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5, tries: int = 5,
                         device: torch.device = torch.device("cpu")) -> float:
    """Best FLOP/s over `tries` timings of `repeats` n x n @ n x n matmuls on `device` (on the CPU,
    on all of torch's threads)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    out = torch.empty(n, n, dtype=dtype, device=device)
    torch.matmul(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(tries):
        t0 = now(device)
        for _ in range(repeats):
            torch.matmul(a, b, out=out)
        best = min(best, (now(device) - t0) / repeats)
    del a, b, out
    free_memory(device)
    return 2 * n ** 3 / best


class OtherLoad:
    """Share of the machine's CPU time that other processes (and the hypervisor) took since construction.
    This benchmark needs every core: one busy neighbour slows torch's parallel regions many times over."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def share(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall, busy, own = (e - s for e, s in zip(end, self.start))
        return max(0.0, (busy - own) / (wall * os.cpu_count()))
