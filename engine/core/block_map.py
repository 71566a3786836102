"""The block map: every device and host block with its state, ref count and owners, as an
immutable snapshot for the live panel. Built on the engine thread between steps, O(pool)."""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.request import Request


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


def snapshot_block_map(device: BlockPool, host: BlockPool, requests: Iterable[Request]) -> BlockMap:
    """Both pools' blocks, each with the ids of the requests whose block tables hold it."""
    device_owners: dict[int, list[str]] = {}
    host_owners: dict[int, list[str]] = {}
    for request in requests:
        for block_id in request.block_ids:
            device_owners.setdefault(block_id, []).append(request.request_id)
        for block_id in request.host_block_ids:
            host_owners.setdefault(block_id, []).append(request.request_id)
    return BlockMap(device.block_size, _block_infos(device, device_owners), _block_infos(host, host_owners))


def _block_infos(pool: BlockPool, owners: dict[int, list[str]]) -> tuple[BlockInfo, ...]:
    infos = []
    for block in pool.blocks:
        if block.ref_count:
            state = BlockState.USED
        elif block.block_hash is not None:
            state = BlockState.CACHED
        else:
            state = BlockState.FREE
        infos.append(BlockInfo(block.block_id, state, block.ref_count, block.num_tokens, block.block_hash,
                               tuple(owners.get(block.block_id, ()))))
    return tuple(infos)
