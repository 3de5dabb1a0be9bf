"""BlockPool: reference counts, the LRU free list and the prefix-cache map (no model)."""

from __future__ import annotations

import pytest

from pagedserve.core.block_pool import BlockPool


def check_pool(pool: BlockPool) -> None:
    """Free list holds exactly the blocks with ref_count 0; the hash map points at blocks with that hash."""
    free_ids = set(pool.free)
    for b in pool.blocks:
        assert b.ref_count >= 0
        assert (b.ref_count == 0) == (b.block_id in free_ids)
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    for h, b in pool.cached.items():
        assert b.block_hash == h
        assert b.token_ids is not None


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockPool(0)


def test_allocate_and_release_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert len({b.block_id for b in blocks}) == 3
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(0.75)
    check_pool(pool)
    pool.release(blocks)
    assert pool.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in pool.blocks)
    check_pool(pool)


def test_allocate_too_many_raises():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_double_release_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])


def test_lru_order_of_free_list():
    """Blocks come back least recently freed first."""
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.release([b])
    pool.release([c])
    pool.release([a])
    again = pool.allocate(3)
    assert [x.block_id for x in again] == [b.block_id, c.block_id, a.block_id]


def test_cached_block_survives_free_and_is_found_again():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h1", (1, 2))
    pool.release([b])
    assert b.ref_count == 0 and b.block_hash == b"h1"
    assert pool.num_cached_free_blocks == 1
    assert pool.lookup(b"h1", (1, 2)) is b
    assert pool.lookup(b"h1", (1, 3)) is None  # collision guard: tokens must match too
    pool.touch([b])  # a hit on a free block takes it out of the free list
    assert b.ref_count == 1 and b.block_id not in pool.free
    pool.touch([b])  # a second owner
    assert b.ref_count == 2
    check_pool(pool)
    pool.release([b, b])
    assert b.ref_count == 0
    check_pool(pool)


def test_eviction_only_when_needed_and_oldest_first():
    pool = BlockPool(2, enable_caching=True)
    x, y = pool.allocate(2)
    pool.cache_block(x, b"x", (1,))
    pool.cache_block(y, b"y", (2,))
    pool.release([x])
    pool.release([y])
    assert pool.lookup(b"x", (1,)) is x and pool.lookup(b"y", (2,)) is y
    (z,) = pool.allocate(1)  # evicts the least recently freed: x
    assert z is x
    assert z.block_hash is None and z.token_ids is None
    assert pool.lookup(b"x", (1,)) is None
    assert pool.lookup(b"y", (2,)) is y
    assert pool.num_evicted == 1
    check_pool(pool)


def test_caching_disabled_drops_hashes():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h", (1,))
    assert b.block_hash is None and not pool.cached
    pool.release([b])
    assert pool.lookup(b"h", (1,)) is None
    check_pool(pool)


def test_cache_block_keeps_the_first_holder():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h", (7,))
    pool.cache_block(b, b"h", (7,))
    assert pool.cached[b"h"] is a
    assert b.block_hash is None
    pool.release([a, b])
    check_pool(pool)


def test_reset_prefix_cache_clears_free_blocks_only():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"a", (1,))
    pool.cache_block(b, b"b", (2,))
    pool.release([a])
    pool.reset_prefix_cache()
    assert pool.lookup(b"a", (1,)) is None
    assert pool.lookup(b"b", (2,)) is b  # still in use: keeps its hash
    pool.release([b])
    check_pool(pool)
