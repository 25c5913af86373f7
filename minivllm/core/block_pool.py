"""BlockPool: owns every KV cache block, its reference count and the free queue.

The KV cache is preallocated once as ``num_blocks`` fixed-size blocks (notebook 03). A
block is *owned* while at least one request's block table lists it (``ref_cnt > 0``) and
*free* otherwise. The invariant this module keeps:

    every block is either in the free queue (ref_cnt == 0) or in some block table
    (ref_cnt > 0), never both and never neither.

The free queue is kept in least-recently-freed order. With prefix caching (notebook 07) a
freed block keeps its content hash and stays findable in ``cached_blocks`` until the pool
hands it out again: eviction is lazy, and the block evicted is always the one freed
longest ago. A cache hit on a free block takes it back out of the queue.

An ``OrderedDict`` is the free queue: O(1) pop from the front, append at the back and
removal from the middle, which is what vLLM's hand-written doubly linked list provides.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    """Set while the block holds a full, cached block of tokens (prefix caching)."""

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      cache_salt: str | None = None) -> bytes:
    """Hash of a full block, chained to its parent's hash.

    Because each hash covers the parent's hash, equal hashes mean equal *whole prefixes*,
    not just equal blocks. SHA-256 is stable across processes (Python's ``hash`` of a
    tuple is not, for strings), so a hash computed today matches one computed tomorrow.

    ``cache_salt`` (vLLM's request field) goes into the *first* block's hash only: the
    chain carries it into every later block, so requests with different salts share no
    cached block, and a user cannot learn from a fast first token that another user sent
    the same prompt.
    """
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    if cache_salt is not None:
        h.update(b"\x00salt:" + cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    # -- allocation -------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue (least recently freed)."""
        if n > len(self.free_block_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_block_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_block_queue.popitem(last=False)
            self.evict_cached_block(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts sharing these cached blocks: count it, and unfree them."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue
        in the given order, so the first given is the first evicted."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    # -- prefix caching ---------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its hash. If an identical block is already cached
        (two requests computed the same prefix at once) the first one stays canonical."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        """Forget the block's hash, if it has one: its content is about to change (it is
        reused for other tokens), or was never written (a failed step)."""
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use,
        since a running request's blocks may be mid-computation."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    # -- observation ------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of blocks owned by some request (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def check_invariants(self) -> None:
        """Every block is free (ref 0, in the queue) or owned (ref > 0, not in it)."""
        for block in self.blocks:
            in_queue = block.block_id in self.free_block_queue
            assert block.ref_cnt >= 0, block
            assert in_queue == (block.ref_cnt == 0), f"{block} in_queue={in_queue}"
        for h, block in self.cached_blocks.items():
            assert block.block_hash == h
