"""The pool of physical KV blocks: reference counts, an O(1) LRU free list and the prefix-cache map.

A freed block keeps its contents and hash: it sits in the free list (least recently freed first) and
can be found again by hash until it is evicted, which happens only when a block is needed and it is
the oldest free one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash: a hit must match the tokens too


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        # Counters read (and reset) by the engine's step record.
        self.num_allocated = 0
        self.num_freed = 0
        self.num_evicted = 0
        self._num_cached_free = 0  # free blocks that still hold a cached prefix (kept, not scanned)

    # ---- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (plain free and cached-free)."""
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:  # collision guard
            return None
        return block

    # ---- mutations ---------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)  # least recently freed first
            if block.block_hash is not None:
                self._num_cached_free -= 1
                self._evict(block)
            block.ref_count = 1
            out.append(block)
        self.num_allocated += n
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it out of the free list."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free[block.block_id]
                self._num_cached_free -= block.block_hash is not None
            block.ref_count += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference each; blocks reaching zero go to the tail of the free list, in order."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            if block.ref_count == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._reset(block)
                else:
                    self._num_cached_free += 1
                self.free[block.block_id] = block
                self.num_freed += 1

    def cache_block(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # another block already holds these tokens; keep the first
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block

    def uncache(self, block: Block) -> None:
        """Take a block out of the prefix cache (its K/V may not be what its hash says)."""
        self._reset(block)

    def _evict(self, block: Block) -> None:
        self.num_evicted += 1
        self._reset(block)

    def _reset(self, block: Block) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids = None, None

    def reset_prefix_cache(self) -> None:
        for block in self.free.values():
            self._reset(block)
        self._num_cached_free = 0
