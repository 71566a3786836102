"""`GET /v1/kv_cache`: the engine's pools and every block's state as compact JSON, for a remote
app's panel. A pool of 100k blocks is a few hundred kilobytes: one character per block's state,
and run-length lists for ref counts, owners and the shared-prefix flag (mostly runs of the same
value)."""
from __future__ import annotations

from engine.core.block_map import BlockInfo, BlockMap, BlockState
from engine.core.config import EngineConfig, SchedulerConfig
from engine.core.stats import SchedulerStats
from engine.outputs import EngineInfo

STATE_CODES = {BlockState.FREE: "f", BlockState.CACHED: "c", BlockState.USED: "u"}


def kv_cache_json(info: EngineInfo, stats: SchedulerStats, block_map: BlockMap) -> dict:
    """Pool sizes and usage, then per pool: `states` (one of f/c/u per block), `ref_counts`,
    `owners` and `shared_prefix` as [value, run length] pairs; an owner is an index into
    `requests` (or -1); `shared_prefix` is 1 for a block holding a preset system prompt (the
    unsalted prefix every user shares, `BlockInfo.shared_prefix`), else 0."""
    requests: dict[str, int] = {}
    return {
        "model": info.model, "weights": info.weights, "block_size": block_map.block_size, "max_model_len": info.max_model_len,
        "device": {"num_blocks": info.num_device_blocks, "used": stats.device_blocks_used,
                   "cached": stats.device_blocks_cached, **_pool(block_map.device, requests)},
        "host": {"num_blocks": info.num_host_blocks, "used": stats.host_blocks_used,
                 **_pool(block_map.host, requests)},
        "requests": list(requests),
        "running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped,
        "config": info.config.as_dict() if info.config is not None else None,
    }


def _pool(blocks: tuple[BlockInfo, ...], requests: dict[str, int]) -> dict:
    def owner(block: BlockInfo) -> int:
        if not block.owners:
            return -1
        return requests.setdefault(block.owners[0], len(requests))

    return {"states": "".join(STATE_CODES[b.state] for b in blocks),
            "ref_counts": _runs(b.ref_count for b in blocks),
            "owners": _runs(owner(b) for b in blocks),
            "shared_prefix": _runs(int(b.shared_prefix) for b in blocks)}


def _runs(values) -> list[list[int]]:
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs


_STATES_BY_CODE = {code: state for state, code in STATE_CODES.items()}


def _config(data) -> EngineConfig | None:
    """The serving engine's configuration (`EngineConfig.as_dict`), where it sends one."""
    if data is None:
        return None
    try:
        return EngineConfig(**{**data, "scheduler": SchedulerConfig(**data["scheduler"]),
                               "step_paths": tuple(data["step_paths"])})
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"kv_cache.config: not an engine configuration ({type(error).__name__}: {error})") from None


def block_map_from_kv_cache_json(data: dict, *, device: str = "remote") -> tuple[BlockMap, EngineInfo]:
    """The inverse of `kv_cache_json`, for drawing a remote server's pools with the panel's block
    map. The JSON carries no hashes, token counts or owners past the first: blocks come back with
    `block_hash=None`, `num_tokens=0` and at most one owner. `shared_prefix` may be missing (older
    PagedChat servers do not send it): then no block is flagged. The info's `device` is what the
    caller says (the server does not tell), its dtype and kernels "unknown". Raises ValueError
    naming what is wrong in a malformed body (it comes from another machine)."""
    if not isinstance(data, dict):
        raise ValueError(f"kv_cache: expected a JSON object, got {type(data).__name__}")
    block_size = _int(data, "block_size", "kv_cache", minimum=1)
    requests = data.get("requests", [])
    if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
        raise ValueError("kv_cache.requests: expected a list of request id strings")
    pools = {name: _pool_blocks(data.get(name), name, requests) for name in ("device", "host")}
    model = data.get("model")
    max_model_len = data.get("max_model_len") or 0
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool):
        raise ValueError(f"kv_cache.max_model_len: expected an integer, got {max_model_len!r}")
    info = EngineInfo(model=str(model) if model is not None else "unknown", device=device, dtype="unknown",
                      block_size=block_size, num_device_blocks=len(pools["device"]),
                      num_host_blocks=len(pools["host"]), kernels="unknown", max_model_len=max_model_len,
                      weights=str(data.get("weights") or ""), config=_config(data.get("config")))
    return BlockMap(block_size, pools["device"], pools["host"]), info


def _int(data: dict, key: str, where: str, minimum: int = 0) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}.{key}: expected an integer of at least {minimum}, got {value!r}")
    return value


def _pool_blocks(pool: object, name: str, requests: list[str]) -> tuple[BlockInfo, ...]:
    where = f"kv_cache.{name}"
    if not isinstance(pool, dict):
        raise ValueError(f"{where}: expected an object, got {type(pool).__name__}")
    num_blocks = _int(pool, "num_blocks", where)
    codes = pool.get("states")
    if not isinstance(codes, str):
        raise ValueError(f"{where}.states: expected a string of f/c/u letters")
    if len(codes) != num_blocks:
        raise ValueError(f"{where}.states: {len(codes)} letters for num_blocks={num_blocks}")
    unknown = set(codes) - _STATES_BY_CODE.keys()
    if unknown:
        raise ValueError(f"{where}.states: unknown state letter(s) {''.join(sorted(unknown))!r} (expected f, c or u)")
    ref_counts = _unrun(pool.get("ref_counts"), f"{where}.ref_counts", num_blocks, minimum=0)
    owners = _unrun(pool.get("owners"), f"{where}.owners", num_blocks, minimum=-1)
    if owners and max(owners) >= len(requests):
        raise ValueError(f"{where}.owners: owner index {max(owners)} out of range ({len(requests)} requests)")
    shared = ([0] * num_blocks if pool.get("shared_prefix") is None
              else _unrun(pool["shared_prefix"], f"{where}.shared_prefix", num_blocks, minimum=0, maximum=1))
    return tuple(BlockInfo(block_id, _STATES_BY_CODE[code], refs, 0, None, (requests[owner],) if owner >= 0 else (),
                           bool(flag))
                 for block_id, (code, refs, owner, flag) in enumerate(zip(codes, ref_counts, owners, shared)))


def _unrun(runs: object, where: str, num_blocks: int, minimum: int, maximum: int | None = None) -> list[int]:
    """[value, run length] pairs back to one value per block; the runs must cover the pool exactly."""
    if not isinstance(runs, list):
        raise ValueError(f"{where}: expected a list of [value, run length] pairs")
    allowed = f">= {minimum}" if maximum is None else f"{minimum}..{maximum}"
    for i, run in enumerate(runs):
        if (not isinstance(run, list) or len(run) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in run)
                or run[0] < minimum or (maximum is not None and run[0] > maximum) or run[1] < 1):
            raise ValueError(f"{where}[{i}]: expected [value {allowed}, run length >= 1], got {run!r}")
    total = sum(length for _, length in runs)  # checked before expanding: a hostile length stays a number
    if total != num_blocks:
        raise ValueError(f"{where}: runs add up to {total} blocks, num_blocks is {num_blocks}")
    return [value for value, length in runs for _ in range(length)]
