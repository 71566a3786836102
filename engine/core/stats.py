"""Immutable snapshots of the engine's memory and queues, for the live panel and the API.

The engine thread builds them; other threads only read them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    step: int
    timestamp: float
    device_blocks_total: int
    device_blocks_used: int
    device_blocks_cached: int  # free, but still holding a reusable prefix block
    host_blocks_total: int
    host_blocks_used: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions_swap: int       # cumulative
    num_preemptions_recompute: int  # cumulative
    blocks_swapped_out: int         # this step
    blocks_swapped_in: int          # this step
    blocks_copied: int              # this step (copy-on-write)
    prefix_cache_queries: int       # cumulative, tokens
    prefix_cache_hits: int          # cumulative, tokens
    num_prefill_tokens: int         # this step
    num_decode_tokens: int          # this step
    # Cumulative over the scheduler's life (a sampler between steps sees what it missed).
    total_prompt_tokens: int = 0          # prefill tokens computed
    total_generated_tokens: int = 0       # decode tokens computed
    total_blocks_swapped_out: int = 0
    total_blocks_swapped_in: int = 0

    @property
    def device_usage(self) -> float:
        return self.device_blocks_used / self.device_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class BlockState(str, enum.Enum):
    FREE = "free"      # holds nothing reusable
    CACHED = "cached"  # free, but still findable by hash until evicted
    USED = "used"      # referenced by at least one request (shared when ref_count > 1)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    block_id: int
    state: BlockState
    ref_count: int
    num_tokens: int
    block_hash: int | None
    owners: tuple[str, ...]  # request ids whose block tables hold it


@dataclass(frozen=True, slots=True)
class BlockMap:
    block_size: int
    device: tuple[BlockInfo, ...]
    host: tuple[BlockInfo, ...]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """When a request's first token arrived and how long it took from submission."""
    request_id: str
    timestamp: float  # time.time(), the clock of SchedulerStats.timestamp
    ttft_s: float


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine runs on; fixed for its life."""
    model: str
    device: str      # "cuda:0", "cpu"
    dtype: str       # "bfloat16", "float32"
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    kernels: str     # "triton" or "torch"

    @property
    def on_cpu(self) -> bool:
        return self.device.startswith("cpu")
