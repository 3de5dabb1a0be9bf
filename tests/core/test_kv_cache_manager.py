"""KVCacheManager: block tables, chained prefix hashes, cache hits and freeing (no model)."""

from __future__ import annotations

import pytest

from pagedserve.core.kv_cache_manager import ROOT_HASH, KVCacheManager, hash_block
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0), max_tokens=8)


def prefill(kv: KVCacheManager, req: Request, computed=None) -> None:
    """Admit a waiting request the way the scheduler does and mark its whole prompt computed."""
    computed = computed if computed is not None else kv.get_computed_blocks(req)
    num_cached = len(computed) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - num_cached, computed) is not None
    req.num_computed_tokens = req.num_tokens


def test_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_blocks_needed_rounds_up():
    kv = KVCacheManager(8, 4)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_hashes_chain_over_the_whole_prefix():
    a = hash_block(ROOT_HASH, (1, 2))
    b = hash_block(a, (3, 4))
    assert b != hash_block(ROOT_HASH, (3, 4))  # same tokens, different prefix → different hash
    assert a == hash_block(ROOT_HASH, (1, 2))


def test_allocate_grows_block_table_as_tokens_arrive():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    req = make_request("a", list(range(6)))
    new = kv.allocate_slots(req, 6)
    assert new is not None and len(new) == 2
    req.num_computed_tokens = 6
    req.append_output_token(100)
    assert kv.allocate_slots(req, 1) == []  # token 7 fits in block 2
    req.num_computed_tokens = 7
    req.append_output_token(101)
    req.num_computed_tokens = 7
    assert kv.allocate_slots(req, 1) == []  # token 8
    req.num_computed_tokens = 8
    req.append_output_token(102)
    assert len(kv.allocate_slots(req, 1)) == 1  # token 9 needs a third block
    assert len(kv.block_table("a")) == 3
    assert kv.pool.num_used_blocks == 3
    kv.free(req)
    assert kv.pool.num_used_blocks == 0
    assert kv.block_table("a") == []


def test_allocate_returns_none_when_out_of_blocks_and_changes_nothing():
    kv = KVCacheManager(2, 4, enable_prefix_caching=False)
    req = make_request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.pool.num_used_blocks == 0
    assert kv.block_table("a") == []


def test_prefix_hit_shares_full_blocks_never_the_last_token():
    kv = KVCacheManager(16, 4)
    shared = list(range(10, 18))  # two full blocks
    a = make_request("a", shared + [1, 2, 3])
    prefill(kv, a)
    b = make_request("b", shared + [4, 5])
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == kv.block_table("a")[:2]
    prefill(kv, b, hits)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    for blk in hits:
        assert blk.ref_count == 2
    # A prompt that is exactly the cached blocks still computes its last token itself.
    c = make_request("c", shared)
    assert len(kv.get_computed_blocks(c)) == 1


def test_prefix_lookup_counters():
    on, off = KVCacheManager(8, 4), KVCacheManager(8, 4, enable_prefix_caching=False)
    for kv in (on, off):
        kv.record_prefix_lookup(10, 8)
        kv.record_prefix_lookup(5, 0)
    assert (on.prefix_queries, on.prefix_hits) == (15, 8)
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)


def test_different_prefix_same_block_tokens_is_a_miss():
    kv = KVCacheManager(16, 4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(kv, a)
    b = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # block 2 tokens equal, block 1 differs
    assert kv.get_computed_blocks(b) == []


def test_freed_cached_blocks_are_hits_until_evicted():
    kv = KVCacheManager(4, 4)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    kv.forget(a)
    assert kv.pool.num_used_blocks == 0
    assert kv.pool.num_cached_free_blocks == 2  # the partial third block is not cached
    b = make_request("b", list(range(8)) + [99])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2 and all(h.ref_count == 0 for h in hits)
    prefill(kv, b, hits)
    assert all(h.ref_count == 1 for h in hits)
    assert kv.pool.num_used_blocks == 3
    kv.free(b)
    # Fill the pool with unrelated tokens: the cached blocks get evicted.
    c = make_request("c", [500 + i for i in range(16)])
    prefill(kv, c)
    d = make_request("d", list(range(8)) + [99])
    assert kv.get_computed_blocks(d) == []


def test_free_hits_count_against_free_blocks():
    """A hit on a free cached block uses up one free block; allocation must account for it."""
    kv = KVCacheManager(3, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(kv, a)  # 3 blocks, two cached
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9])  # 2 hits + needs 2 more blocks = 4 > 3
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert kv.allocate_slots(b, 3, hits) is None
    assert kv.pool.num_used_blocks == 0
    assert all(h.ref_count == 0 for h in hits)


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b) == []
    assert not kv.pool.cached


def test_free_releases_tail_first():
    """The earliest (most shareable) blocks of a request are evicted last."""
    kv = KVCacheManager(3, 2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # 7 tokens → 4 blocks of 2: more than the pool has
    assert kv.allocate_slots(a, 7) is None
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    prefill(kv, a)
    table = kv.block_table("a")
    kv.free(a)
    assert list(kv.pool.free) == list(reversed(table))
