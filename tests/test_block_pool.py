import pytest

from engine.core.block_pool import BlockPool, DoubleFreeError, NoFreeBlocksError


def test_allocate_until_empty_then_refuse():
    pool = BlockPool(3, 16, caching=True)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(b.block_id for b in blocks) == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free == 0 and pool.num_used == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_free_returns_block_and_double_free_raises():
    pool = BlockPool(2, 16, caching=True)
    block = pool.allocate()
    pool.free(block)
    assert pool.num_free == 2 and block.ref_count == 0
    with pytest.raises(DoubleFreeError):
        pool.free(block)
    assert pool.num_free == 2


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(2, 16, caching=True)
    block = pool.allocate()
    pool.touch(block)
    pool.free(block)
    assert pool.num_free == 1 and block.ref_count == 1
    pool.free(block)
    assert pool.num_free == 2


def test_freed_hashed_block_stays_findable_until_evicted():
    pool = BlockPool(2, 4, caching=True)
    block = pool.allocate()
    pool.register(block, 1234)
    pool.free(block)
    assert pool.num_cached_free == 1
    assert pool.lookup(1234) is block
    other = pool.allocate()  # the plain free block goes first
    assert other is not block and pool.lookup(1234) is block
    evicted = pool.allocate()  # now the cached block must be evicted
    assert evicted is block and block.block_hash is None and pool.lookup(1234) is None
    assert pool.num_evictions == 1


def test_touch_revives_a_cached_free_block():
    pool = BlockPool(1, 4, caching=True)
    block = pool.allocate()
    pool.register(block, 7)
    pool.free(block)
    pool.touch(block)
    assert block.ref_count == 1 and pool.num_free == 0 and pool.lookup(7) is block


def test_lru_evicts_least_recently_freed_first():
    pool = BlockPool(3, 4, caching=True)
    a, b, c = (pool.allocate() for _ in range(3))
    for block, h in ((a, 1), (b, 2), (c, 3)):
        pool.register(block, h)
    for block in (b, c, a):
        pool.free(block)
    assert [pool.allocate() for _ in range(3)] == [b, c, a]


def test_duplicate_contents_stay_unregistered_and_free_plain():
    pool = BlockPool(2, 4, caching=True)
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, 5)
    pool.register(second, 5)
    assert pool.lookup(5) is first and second.block_hash is None
    pool.free(second)
    assert pool.num_cached_free == 0


def test_pool_without_caching_forgets_hashes_on_free():
    pool = BlockPool(1, 4, caching=False)
    block = pool.allocate()
    block.block_hash = 99  # a host block remembering its device block's hash
    pool.free(block)
    assert block.block_hash is None and pool.num_cached_free == 0 and pool.lookup(99) is None
