"""The block map: every device and host block with its state, ref count and owners, as an
immutable snapshot for the live panel.

Walking a whole pool in Python on the engine thread would stall decoding (~0.3 s at 170k
blocks). Instead each pool records which blocks changed (`BlockPool.dirty`), and a `PoolMirror`
owned by the scheduler keeps numpy copies of the per-block fields current from those alone. The
engine thread's share of a snapshot is that update plus array and block-table copies
(`BlockMapState`); the reader's thread turns the state into `BlockInfo`s (`build()`).

Which blocks hold a shared prefix (a preset system prompt, hashed without the user's salt:
engine/core/block_hash.py) is not a property of the block but of the requests holding it: a
request's first `num_shared_prefix_tokens // block_size` blocks. So the tables carry that
count per request, and `build()` flags the blocks from it.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

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
    # It lies within some owner's shared prefix: the unsalted blocks every user of a preset
    # system prompt hits (engine/core/block_hash.py). False for blocks no request holds.
    shared_prefix: bool = False


@dataclass(frozen=True, slots=True)
class BlockMap:
    block_size: int
    device: tuple[BlockInfo, ...]
    host: tuple[BlockInfo, ...]


@dataclass(frozen=True, slots=True)
class PoolState:
    """One pool's per-block fields at one moment (copies: the engine goes on changing the pool)."""
    ref_count: np.ndarray
    num_tokens: np.ndarray
    hashes: tuple[int | None, ...]


class PoolMirror:
    """Numpy copies of one pool's per-block fields, brought up to date from its dirty blocks."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        n = pool.num_blocks
        self.ref_count = np.zeros(n, dtype=np.int32)
        self.num_tokens = np.zeros(n, dtype=np.int32)
        self.hashes: list[int | None] = [None] * n
        pool.dirty.update(range(n))  # the first sync reads every block

    def sync(self) -> PoolState:
        blocks, ref_count, num_tokens, hashes = self.pool.blocks, self.ref_count, self.num_tokens, self.hashes
        for block_id in self.pool.dirty:
            block = blocks[block_id]
            ref_count[block_id] = block.ref_count
            num_tokens[block_id] = block.num_tokens
            hashes[block_id] = block.block_hash
        self.pool.dirty.clear()
        return PoolState(ref_count.copy(), num_tokens.copy(), tuple(hashes))


@dataclass(frozen=True, slots=True)
class BlockMapState:
    """What the engine thread copies for a block map; `build()` runs on the reader's thread."""
    block_size: int
    device: PoolState
    host: PoolState
    # (request id, device ids, host ids, how many leading blocks hold its unsalted shared prefix)
    tables: tuple[tuple[str, tuple[int, ...], tuple[int, ...], int], ...]

    @staticmethod
    def take(device: PoolMirror, host: PoolMirror, requests: Iterable[Request]) -> BlockMapState:
        block_size = device.pool.block_size
        tables = tuple((r.request_id, tuple(r.block_ids), tuple(r.host_block_ids),
                        num_shared_prefix_blocks(r, block_size)) for r in requests)
        return BlockMapState(block_size, device.sync(), host.sync(), tables)

    def build(self) -> BlockMap:
        device_owners: dict[int, list[str]] = {}
        host_owners: dict[int, list[str]] = {}
        device_shared: set[int] = set()
        host_shared: set[int] = set()
        for request_id, device_ids, host_ids, num_shared in self.tables:
            for block_id in device_ids:
                device_owners.setdefault(block_id, []).append(request_id)
            for block_id in host_ids:
                host_owners.setdefault(block_id, []).append(request_id)
            # A swapped request's host table lists its blocks in the same order as its device table did.
            device_shared.update(device_ids[:num_shared])
            host_shared.update(host_ids[:num_shared])
        return BlockMap(self.block_size, _block_infos(self.device, device_owners, device_shared),
                        _block_infos(self.host, host_owners, host_shared))


def num_shared_prefix_blocks(request: Request, block_size: int) -> int:
    """Leading blocks of the request hashed without its salt: whole blocks of its shared prefix.
    Without a salt nothing is salted, but nothing is a preset either: no block counts."""
    if request.cache_salt is None:
        return 0
    return request.num_shared_prefix_tokens // block_size


def _block_infos(pool: PoolState, owners: dict[int, list[str]], shared: set[int]) -> tuple[BlockInfo, ...]:
    used, cached, free = BlockState.USED, BlockState.CACHED, BlockState.FREE
    return tuple(
        BlockInfo(block_id, used if refs else cached if block_hash is not None else free, refs, tokens, block_hash,
                  tuple(owners.get(block_id, ())), block_id in shared)
        for block_id, (refs, tokens, block_hash) in enumerate(zip(pool.ref_count.tolist(), pool.num_tokens.tolist(),
                                                                  pool.hashes)))
