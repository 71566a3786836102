"""The KV-cache manager: which blocks each request holds on the device and, while swapped, on
the host; prefix-cache lookups; copy-on-write for forked samples; swap plans.

A prompt's prefix is found in two parts: the leading full blocks whose hashes are cached, then,
in the block after them, the most tokens a cached block under the same parent begins with (its
K/V for those positions is the same, since they and everything before them are). That block is
copied into a new one and the prompt computes only past the common tokens. A chat's shared
system prompt rarely ends on a block boundary: without this, every new chat recomputes the
prompt's last partial block (up to block_size - 1 tokens; on average half a block).

It decides nothing about who runs (the scheduler does) and moves no bytes (the model runner
does): it hands back the (src, dst) block pairs to copy.
"""
from __future__ import annotations

from engine.core.block_hash import DEFAULT_HASH_ALGO, ROOT_HASH, extend_block_hashes
from engine.core.block_pool import Block, BlockPool, NoFreeBlocksError
from engine.core.request import Request

_NONE: list[int] = []  # shared "no new blocks" result: never mutated
PARTIAL_CANDIDATES = 32  # cached siblings a partial-block lookup compares at most


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True, hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.device = BlockPool(num_device_blocks, block_size, caching=enable_prefix_caching)
        self.host = BlockPool(num_host_blocks, block_size, caching=False)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0     # of those, tokens found cached
        self._pinned: list[Block] = []  # partial hits' sources, held until the step's allocations are done

    # ---- prefix cache -------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of leading full blocks whose hashes are cached. At least one token is
        always left to compute, since the step that computes it also samples the next token."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_blocks(request, max_blocks)
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.device.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_partial_block(self, request: Request, num_cached_blocks: int) -> tuple[Block, int] | None:
        """A cached block under the same parent as the request's block `num_cached_blocks` that
        begins with the most of that block's tokens, and how many (at least one token is left
        to compute). Across salts only tokens inside both requests' shared prefixes are shared:
        a user's own tokens are never found from another user's prompt, as with the hashes."""
        if not self.enable_prefix_caching:
            return None
        bs = self.block_size
        start = num_cached_blocks * bs
        limit = min(bs, request.num_tokens - 1 - start)
        if limit <= 0:
            return None
        parent = request.block_hashes[num_cached_blocks - 1] if num_cached_blocks else ROOT_HASH
        tokens = request.all_token_ids[start:start + limit]
        ours = self._shareable(request, start)
        best, best_len = None, 0
        for block in self.device.children(parent, PARTIAL_CANDIDATES):
            cap = limit if block.salt == request.cache_salt else min(limit, ours, block.shareable)
            n = 0
            while n < cap and block.token_ids[n] == tokens[n]:
                n += 1
            if n > best_len:
                best, best_len = block, n
                if n == limit:
                    break
        return (best, best_len) if best is not None else None

    def _shareable(self, request: Request, start: int) -> int:
        """Of the block starting at token `start`, the leading tokens any request may share:
        all of them unsalted, else those inside the request's shared prefix."""
        if request.cache_salt is None:
            return self.block_size
        return max(0, min(self.block_size, request.num_shared_prefix_tokens - start))

    def _hash_blocks(self, request: Request, num_blocks: int) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_blocks,
                            request.cache_salt, request.num_shared_prefix_tokens // self.block_size, self.hash_algo)

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Offer blocks whose every token is now computed to the prefix cache."""
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        self._hash_blocks(request, num_full)
        blocks = self.device.blocks
        bs = self.block_size
        hashes, tokens = request.block_hashes, request.all_token_ids
        for i in range(request.num_registered_blocks, num_full):
            self.device.register(blocks[request.block_ids[i]], hashes[i], hashes[i - 1] if i else ROOT_HASH,
                                 tuple(tokens[i * bs:(i + 1) * bs]), request.cache_salt, self._shareable(request, i * bs))
        request.num_registered_blocks = num_full

    # ---- device allocation --------------------------------------------------------------
    def num_blocks_to_admit(self, request: Request, cached: list[Block], num_new_tokens: int,
                            partial: tuple[Block, int] | None = None) -> int:
        """Free device blocks a waiting request would take: new blocks (the partial hit's copy
        among them), plus hits that currently sit in the free queue (taking them removes them
        from it; a partial hit's source is held while the step is planned)."""
        taken = cached + [partial[0]] if partial else cached
        num_cached_tokens = len(cached) * self.block_size + (partial[1] if partial else 0)
        new_blocks = cdiv(num_cached_tokens + num_new_tokens, self.block_size) - len(cached)
        return new_blocks + sum(1 for b in taken if b.ref_count == 0)

    def admit(self, request: Request, cached: list[Block], num_new_tokens: int,
              partial: tuple[Block, int] | None = None) -> tuple[list[int], tuple[int, int] | None]:
        """Give a waiting request its cached prefix and room for its first chunk: the new block
        ids and, for a partial hit, the (src, dst) pair to copy before the step. The caller has
        checked `num_blocks_to_admit` against the free count."""
        for block in cached:
            self.device.touch(block)
        request.block_ids = [b.block_id for b in cached]
        request.num_registered_blocks = len(cached)
        request.num_computed_tokens = len(cached) * self.block_size
        if partial is None:
            new_ids, _ = self.allocate_slots(request, num_new_tokens)
            return new_ids, None
        # The source is held until `release_pinned` (the end of the step's planning), so no
        # allocation made meanwhile can evict it and hand it out before the copy reads it.
        src, num_tokens = partial
        self.device.touch(src)
        self._pinned.append(src)
        dst = self.device.allocate()
        dst.num_tokens = num_tokens
        request.block_ids.append(dst.block_id)
        request.num_computed_tokens += num_tokens
        new_ids, _ = self.allocate_slots(request, num_new_tokens)
        return [dst.block_id, *new_ids], (src.block_id, dst.block_id)

    def release_pinned(self) -> None:
        """Let go of the partial hits' sources once the step's allocations are all made."""
        for block in self._pinned:
            self.device.free(block)
        self._pinned.clear()

    def allocate_slots(self, request: Request, num_new_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
        """Grow the request's block table to hold `num_new_tokens` more tokens. Returns the new
        block ids and the (src, dst) copy-on-write pair, if its shared partial last block had to
        be copied before being written. Raises NoFreeBlocksError (changing nothing) if short."""
        start = request.num_computed_tokens
        bs = self.block_size
        blocks = self.device.blocks
        block_ids = request.block_ids
        if num_new_tokens == 1 and start % bs:
            # The decode fast path: the token goes into the partial last block.
            last = blocks[block_ids[-1]]
            if last.ref_count == 1:
                last.num_tokens += 1
                self.device.changed(last)
                return _NONE, None
        end = start + num_new_tokens
        need = cdiv(end, bs) - len(block_ids)
        cow = self._needs_copy_on_write(request)
        if need + cow > self.device.num_free:
            raise NoFreeBlocksError(f"need {need + cow} blocks, {self.device.num_free} free")
        copy = None
        if cow:
            old = blocks[block_ids[-1]]
            new = self.device.allocate()
            new.num_tokens = old.num_tokens
            self.device.free(old)
            block_ids[-1] = new.block_id
            copy = (old.block_id, new.block_id)
        new_ids = [self.device.allocate().block_id for _ in range(need)] if need > 0 else _NONE
        block_ids.extend(new_ids)
        # Record how many slots each touched block will hold once this step runs.
        for i in range(start // bs, cdiv(end, bs)):
            block = blocks[block_ids[i]]
            block.num_tokens = min(bs, end - i * bs)
            self.device.changed(block)
        return new_ids, copy

    def _needs_copy_on_write(self, request: Request) -> bool:
        """A partial last block still shared with a forked sibling must be copied before the
        next token is written into it."""
        if request.num_computed_tokens % self.block_size == 0 or not request.block_ids:
            return False
        return self.device.blocks[request.block_ids[-1]].ref_count > 1

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent, the partial last one included."""
        for block_id in parent.block_ids:
            self.device.touch(self.device.blocks[block_id])
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, request: Request) -> None:
        """Return every block the request holds. Tail blocks are freed first so that, among its
        cached blocks, the tail is evicted before the head (the head is likelier shared)."""
        blocks = self.device.blocks
        for block_id in reversed(request.block_ids):
            self.device.free(blocks[block_id])
        request.block_ids = []
        request.num_registered_blocks = 0
        hblocks = self.host.blocks
        for block_id in reversed(request.host_block_ids):
            self.host.free(hblocks[block_id])
        request.host_block_ids = []

    def num_exclusive_blocks(self, request: Request) -> int:
        """Blocks only this request holds: what swapping it out would actually free."""
        blocks = self.device.blocks
        return sum(1 for b in request.block_ids if blocks[b].ref_count == 1)

    # ---- swap ---------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool. Returns (device, host) pairs to copy, or
        None (changing nothing) if the host pool is too full. The device blocks keep their
        hashes in the free queue, so a swap-in soon after may not need to copy them back."""
        if len(request.block_ids) > self.host.num_free:
            return None
        pairs = []
        dblocks = self.device.blocks
        for block_id in request.block_ids:
            src = dblocks[block_id]
            dst = self.host.allocate()
            dst.block_hash = src.block_hash
            dst.num_tokens = src.num_tokens
            pairs.append((block_id, dst.block_id))
        host_ids = [dst for _, dst in pairs]
        self.free(request)
        request.host_block_ids = host_ids
        return pairs

    def num_blocks_to_swap_in(self, request: Request, num_new_tokens: int) -> int:
        """Free device blocks that swapping the request in and running `num_new_tokens` takes."""
        need = 0
        for block_id in request.host_block_ids:
            found = self._on_device(self.host.blocks[block_id])
            if found is None or found.ref_count == 0:
                need += 1
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return need + max(0, total - len(request.host_block_ids))

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back. A block whose hash is still cached on the device
        is taken as it is; only the rest are copied. Returns (host, device) pairs to copy."""
        hblocks = self.host.blocks
        # Take every block still cached on the device before allocating any: an allocation may
        # evict a cached block that a later host block could have reused.
        found = [self._on_device(hblocks[host_id]) for host_id in request.host_block_ids]
        for block in found:
            if block is not None:
                self.device.touch(block)
        pairs = []
        device_ids = []
        for host_id, block in zip(request.host_block_ids, found):
            if block is None:
                block = self.device.allocate()
                block.num_tokens = hblocks[host_id].num_tokens
                pairs.append((host_id, block.block_id))
            device_ids.append(block.block_id)
        for host_id in reversed(request.host_block_ids):
            self.host.free(hblocks[host_id])
        request.host_block_ids = []
        request.block_ids = device_ids
        # Blocks copied back come in unregistered; hashing them again re-registers them.
        request.num_registered_blocks = 0
        self.cache_full_blocks(request)
        return pairs

    def _on_device(self, host_block: Block) -> Block | None:
        if host_block.block_hash is None or not self.enable_prefix_caching:
            return None
        return self.device.lookup(host_block.block_hash)
