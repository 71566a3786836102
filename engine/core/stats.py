"""The scheduler's counters as an immutable snapshot, taken after every step, for the live
panel and the API. The engine thread builds them; other threads only read them."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler
    from engine.core.scheduler_output import SchedulerOutput


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


def snapshot_stats(scheduler: Scheduler, out: SchedulerOutput) -> SchedulerStats:
    """The scheduler's state after the step that produced `out` (an empty output between steps)."""
    kv = scheduler.kv
    return SchedulerStats(
        step=scheduler.num_steps, timestamp=time.time(),
        device_blocks_total=kv.device.num_blocks, device_blocks_used=kv.device.num_used,
        device_blocks_cached=kv.device.num_cached_free,
        host_blocks_total=kv.host.num_blocks, host_blocks_used=kv.host.num_used,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), num_swapped=len(scheduler.swapped),
        num_preemptions_swap=scheduler.num_preemptions_swap,
        num_preemptions_recompute=scheduler.num_preemptions_recompute,
        blocks_swapped_out=len(out.blocks_to_swap_out), blocks_swapped_in=len(out.blocks_to_swap_in),
        blocks_copied=len(out.blocks_to_copy),
        prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
        total_prompt_tokens=scheduler.total_prompt_tokens, total_generated_tokens=scheduler.total_generated_tokens,
        total_blocks_swapped_out=scheduler.total_blocks_swapped_out,
        total_blocks_swapped_in=scheduler.total_blocks_swapped_in)
