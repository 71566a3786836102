"""A pool of fixed-size KV-cache blocks: allocation, reference counts and the prefix cache.

Free blocks live in two places. Blocks that hold nothing reusable sit on a plain stack and are
handed out first. Blocks that still hold a hashed, full block of some earlier request sit in an
LRU queue (least recently freed first) and stay findable by hash until allocation runs out of
plain blocks and evicts them from the front. Every operation here is O(1).

A registered block also keeps its tokens and is listed under its parent's hash, so that a prompt
whose next block is not cached whole can still find a cached block that begins with the same
tokens (`children`): the tail of a shared system prompt that does not fill a block.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice


class NoFreeBlocksError(RuntimeError):
    pass


class DoubleFreeError(RuntimeError):
    pass


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block holds a full, hashed block of tokens
    num_tokens: int = 0            # token slots written, 0..block_size
    # While registered: the parent block's hash, the block's tokens, the salt of the request that
    # computed it and how many of its leading tokens anyone may share (all, unless salted).
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    salt: str | None = None
    shareable: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, caching: bool) -> None:
        self.block_size = block_size
        self.caching = caching  # False: freed blocks forget their hash (the host pool, or caching off)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._free_cached: OrderedDict[int, None] = OrderedDict()          # front = evicted first
        self._by_hash: dict[int, Block] = {}
        self._children: dict[int, dict[int, Block]] = {}  # parent hash -> {hash: registered block}
        self.num_evictions = 0
        # Blocks whose ref count, token count or hash changed since the block map last looked:
        # the map copies only these (engine/core/block_map.py). Whoever writes a block's fields
        # outside this class calls `changed`.
        self.dirty: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free(self) -> int:
        return len(self._free_cached)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_free

    def allocate(self) -> Block:
        if self._free_plain:
            block = self.blocks[self._free_plain.pop()]
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            self._unregister(block)
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError(f"all {len(self.blocks)} blocks are in use")
        block.ref_count = 1
        block.num_tokens = 0
        self.dirty.add(block.block_id)
        return block

    def free(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise DoubleFreeError(f"block {block.block_id} freed more times than it was taken")
        block.ref_count -= 1
        self.dirty.add(block.block_id)
        if block.ref_count:
            return
        if self.caching and block.block_hash is not None:
            self._free_cached[block.block_id] = None  # most recently used end
        else:
            if block.block_hash is not None and self._by_hash.get(block.block_hash) is block:
                self._unregister(block)
            block.block_hash = None
            block.num_tokens = 0
            self._free_plain.append(block.block_id)

    def changed(self, block: Block) -> None:
        """Note a change made to the block's fields outside this class."""
        self.dirty.add(block.block_id)

    def lookup(self, block_hash: int) -> Block | None:
        return self._by_hash.get(block_hash)

    def touch(self, block: Block) -> None:
        """Take one more reference to a block found by hash, pulling it off the free queue."""
        if block.ref_count == 0:
            del self._free_cached[block.block_id]
        block.ref_count += 1
        self.dirty.add(block.block_id)

    def register(self, block: Block, block_hash: int, parent_hash: int | None = None, token_ids: tuple[int, ...] = (),
                 salt: str | None = None, shareable: int = 0) -> None:
        """Make a full block findable by its hash and, given its parent's hash and its tokens,
        among its parent's children. A second block with the same contents stays unregistered:
        it is freed as a plain block, and lookups keep finding the first."""
        if block_hash not in self._by_hash:
            block.block_hash = block_hash
            self._by_hash[block_hash] = block
            if parent_hash is not None:
                block.parent_hash, block.token_ids, block.salt, block.shareable = parent_hash, token_ids, salt, shareable
                self._children.setdefault(parent_hash, {})[block_hash] = block
            self.dirty.add(block.block_id)

    def _unregister(self, block: Block) -> None:
        del self._by_hash[block.block_hash]
        if block.parent_hash is not None:
            siblings = self._children[block.parent_hash]
            del siblings[block.block_hash]
            if not siblings:
                del self._children[block.parent_hash]
            block.parent_hash, block.token_ids, block.salt, block.shareable = None, (), None, 0
        block.block_hash = None

    def children(self, parent_hash: int, limit: int) -> list[Block]:
        """Up to `limit` registered blocks whose parent has this hash, most recently registered
        first (a popular parent, a system prompt's last full block, may have thousands)."""
        return list(islice(reversed(self._children.get(parent_hash, {}).values()), limit))

    def free_queue_ids(self) -> tuple[list[int], list[int]]:
        """(plain free ids, cached free ids in eviction order): for snapshots and invariant checks."""
        return list(self._free_plain), list(self._free_cached)

    def registered(self) -> dict[int, Block]:
        return dict(self._by_hash)
