"""Per-request block tables over the BlockPool, with prefix lookup by chained block hashes.

Block i of a request covers its tokens [i*block_size, (i+1)*block_size). A full block's hash chains
its parent's hash with its token ids, so equal hashes mean equal whole prefixes (sha256; a hit also
compares the tokens).
"""

from __future__ import annotations

import hashlib
import struct

from pagedserve.core.block_pool import Block, BlockPool
from pagedserve.core.kv_math import blocks_for_tokens
from pagedserve.core.request import Request

ROOT_HASH = b"pagedserve-root"


def hash_block(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.req_num_offered: dict[str, int] = {}  # leading blocks already offered to the prefix cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # ---- prefix lookup ---------------------------------------------------------------------------
    def _hashes(self, request: Request, upto_tokens: int) -> list[bytes]:
        """Chained hashes of the request's full blocks within its first `upto_tokens` tokens (memoised)."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < upto_tokens // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, tuple(request.all_token_ids[i * bs : (i + 1) * bs])))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """The longest run of cached blocks at the start of the request, never covering its last token."""
        if not self.enable_prefix_caching:
            return []
        limit = request.num_tokens - 1  # the last token must be computed to produce logits
        hashes = self._hashes(request, limit)
        hits: list[Block] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h, tuple(request.all_token_ids[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admitted request (a lookup retried while blocks are short counts once)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # ---- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[Block] | None = None, cache: bool = True
    ) -> list[Block] | None:
        """Make room for `num_new_tokens` more tokens (after any cache hits); None if blocks run out.
        cache=False: do not offer full blocks to the prefix cache now (slots reserved ahead of the step that
        writes them, e.g. a draft model's lookahead)."""
        computed = computed or []
        owned = self.req_blocks.get(request.request_id, [])
        total_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(owned) - len(computed)
        # Hits on free blocks take them out of the free list, so they count against what is free.
        free_hits = sum(1 for b in computed if b.ref_count == 0)
        if num_new_blocks + free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(request, blocks, total_tokens)
        return new_blocks

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks that `num_tokens` tokens need: lookahead slots of rejected draft tokens go
        back to the pool (tail first). Blocks offered to the prefix cache are never among them: those hold
        real tokens only, all within num_computed_tokens."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        offered = self.req_num_offered.get(request.request_id, 0)
        if offered > keep:
            self.req_num_offered[request.request_id] = keep
        self.pool.release(list(reversed(extra)))

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        # Tokens up to num_tokens have their K/V written in this step (before any read, per layer),
        # so their full blocks may be shared from now on.
        # Each block is offered once, when it becomes full, not again at every later step.
        upto = min(num_tokens, request.num_tokens)
        hashes = self._hashes(request, upto)
        bs = self.block_size
        start = self.req_num_offered.get(request.request_id, 0)
        for i in range(start, upto // bs):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i], tuple(request.all_token_ids[i * bs : (i + 1) * bs]))
        self.req_num_offered[request.request_id] = max(start, upto // bs)

    def free(self, request: Request, keep_cached: bool = True) -> None:
        """Release a request's blocks, tail first, so its earliest (most shareable) blocks live longest.
        keep_cached=False: blocks only this request holds leave the prefix cache (a failed step may have
        left their K/V unwritten)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_num_offered.pop(request.request_id, None)
        if not keep_cached:
            for b in blocks:
                if b.ref_count == 1:
                    self.pool.uncache(b)
        self.pool.release(list(reversed(blocks)))

    def forget(self, request: Request) -> None:
        self.req_hashes.pop(request.request_id, None)
