"""Checks that the scheduler and KV-cache manager agree with each other, for tests and debugging.

Raises AssertionError naming the first broken invariant. O(blocks + tokens): not for every
step of a production loop.
"""
from __future__ import annotations

from collections import Counter
from functools import partial

from engine.core.block_pool import BlockPool
from engine.core.checks import require
from engine.core.kv_cache_manager import cdiv
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler

_check = partial(require, error=AssertionError)


def check_invariants(scheduler: Scheduler) -> None:
    kv, bs = scheduler.kv, scheduler.config.block_size
    queues = {RequestStatus.WAITING: list(scheduler.waiting), RequestStatus.RUNNING: scheduler.running,
              RequestStatus.SWAPPED: scheduler.swapped}
    seen = Counter(id(r) for queue in queues.values() for r in queue)
    _check(all(n == 1 for n in seen.values()), "a request sits in two queues, or twice in one")
    _check(len(seen) == len(scheduler.requests), "the queues and the request table disagree")
    for status, queue in queues.items():
        for request in queue:
            _check(request.status is status, f"{request.request_id} is {request.status} but queued as {status}")
            _check(scheduler.requests.get(request.request_id) is request, f"{request.request_id} not in the table")
    for name, queue in (("running", scheduler.running), ("swapped", scheduler.swapped)):
        keys = [(r.arrival, r.sample_index) for r in queue]
        _check(keys == sorted(keys), f"the {name} queue is out of priority order")

    device_refs: Counter[int] = Counter()
    host_refs: Counter[int] = Counter()
    for request in scheduler.requests.values():
        rid = request.request_id
        _check(0 <= request.num_computed_tokens <= request.num_tokens, f"{rid}: computed tokens out of range")
        _check(len(set(request.block_ids)) == len(request.block_ids), f"{rid} holds a device block twice")
        device_refs.update(request.block_ids)
        host_refs.update(request.host_block_ids)
        if request.status is RequestStatus.WAITING:
            _check(not request.block_ids and not request.host_block_ids, f"waiting {rid} holds blocks")
            _check(request.num_computed_tokens == 0, f"waiting {rid} has computed tokens")
        elif request.status is RequestStatus.SWAPPED:
            _check(not request.block_ids, f"swapped {rid} holds device blocks")
            _check(len(request.host_block_ids) == cdiv(request.num_computed_tokens, bs),
                   f"swapped {rid}: host blocks do not match its computed tokens")
        else:
            _check(not request.host_block_ids, f"running {rid} holds host blocks")
            _check(len(request.block_ids) >= cdiv(request.num_computed_tokens, bs),
                   f"running {rid}: too few blocks for its computed tokens")
            _check(len(request.block_ids) <= cdiv(request.num_tokens, bs),
                   f"running {rid}: more blocks than its tokens need")
            for i in range(request.num_registered_blocks):
                block = kv.device.blocks[request.block_ids[i]]
                _check(block.block_hash is None or block.block_hash == request.block_hashes[i],
                       f"{rid}: block {block.block_id} carries another prefix's hash")
    _check_pool(kv.device, device_refs, "device")
    _check_pool(kv.host, host_refs, "host")


def _check_pool(pool: BlockPool, refs: Counter[int], name: str) -> None:
    plain, cached = pool.free_queue_ids()
    free = plain + cached
    _check(len(set(free)) == len(free), f"{name}: a block appears twice in the free queues")
    _check(pool.num_free + pool.num_used == pool.num_blocks, f"{name}: free + used != total")
    free_set = set(free)
    for block in pool.blocks:
        bid = block.block_id
        _check(block.ref_count == refs.get(bid, 0),
               f"{name} block {bid}: ref count {block.ref_count}, held by {refs.get(bid, 0)} block tables")
        _check((block.ref_count == 0) == (bid in free_set), f"{name} block {bid}: free iff unreferenced")
        _check(0 <= block.num_tokens <= pool.block_size, f"{name} block {bid}: token count out of range")
    for bid in cached:
        _check(pool.blocks[bid].block_hash is not None, f"{name} block {bid} is cached-free without a hash")
    for bid in plain:
        _check(pool.blocks[bid].block_hash is None, f"{name} block {bid} is plain-free but keeps a hash")
    registered = pool.registered()
    listed = {child.block_id: parent for parent in {b.parent_hash for b in pool.blocks if b.parent_hash is not None}
              for child in pool.children(parent, pool.num_blocks)}
    for block_hash, block in registered.items():
        _check(block.block_hash == block_hash, f"{name}: the hash table points at block {block.block_id} wrongly")
        if block.parent_hash is not None:
            _check(listed.get(block.block_id) == block.parent_hash,
                   f"{name} block {block.block_id} is registered but not among its parent's children")
    _check(all(registered.get(pool.blocks[bid].block_hash) is pool.blocks[bid] for bid in listed),
           f"{name}: a block no longer registered is still among its parent's children")
    if pool.caching:
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        _check(len(hashed) == len(pool.registered()), f"{name}: a hashed block is missing from the hash table")
