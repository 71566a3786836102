"""`GET /v1/kv_cache`: the engine's pools and every block's state as compact JSON, for a remote
app's panel. A pool of 100k blocks is a few hundred kilobytes: one character per block's state,
and run-length lists for ref counts and owners (mostly runs of the same value)."""
from __future__ import annotations

from engine.core.block_map import BlockInfo, BlockMap, BlockState
from engine.core.stats import SchedulerStats
from engine.outputs import EngineInfo

STATE_CODES = {BlockState.FREE: "f", BlockState.CACHED: "c", BlockState.USED: "u"}


def kv_cache_json(info: EngineInfo, stats: SchedulerStats, block_map: BlockMap) -> dict:
    """Pool sizes and usage, then per pool: `states` (one of f/c/u per block), `ref_counts` and
    `owners` as [value, run length] pairs; an owner is an index into `requests` (or -1)."""
    requests: dict[str, int] = {}
    return {
        "model": info.model, "block_size": block_map.block_size, "max_model_len": info.max_model_len,
        "device": {"num_blocks": info.num_device_blocks, "used": stats.device_blocks_used,
                   "cached": stats.device_blocks_cached, **_pool(block_map.device, requests)},
        "host": {"num_blocks": info.num_host_blocks, "used": stats.host_blocks_used,
                 **_pool(block_map.host, requests)},
        "requests": list(requests),
        "running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped,
    }


def _pool(blocks: tuple[BlockInfo, ...], requests: dict[str, int]) -> dict:
    def owner(block: BlockInfo) -> int:
        if not block.owners:
            return -1
        return requests.setdefault(block.owners[0], len(requests))

    return {"states": "".join(STATE_CODES[b.state] for b in blocks),
            "ref_counts": _runs(b.ref_count for b in blocks),
            "owners": _runs(owner(b) for b in blocks)}


def _runs(values) -> list[list[int]]:
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs
