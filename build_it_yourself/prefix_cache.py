"""Build it yourself, piece 5: the prefix cache's hash chain and hit rule.

Read first: notebook 07 (prefix caching).
Check:      minivllm check prefix_cache build_it_yourself/prefix_cache.py:MyKVCacheManager
Solution:   minivllm/core/kv_cache_manager.py (the engine's KVCacheManager:
            update_block_hashes, find_longest_cache_hit) and hash_block_tokens in
            minivllm/core/block_pool.py

A full block's K/V depend on every token before it, not only on its own tokens. So a
block is identified by a *chain* of hashes: block ``i``'s hash covers block ``i - 1``'s
hash and block ``i``'s tokens. Equal hashes then mean equal whole prefixes, and a lookup
by hash (``self.block_pool.get_cached_block(h)`` -> a block or None) finds K/V that
another request computed for exactly the same beginning.

``get_computed_blocks(request)`` (the engine's) calls your two methods on admission and
counts the statistics; ``allocate_slots`` registers the blocks each step fills under
``request.block_hashes`` (so your chain is also what gets cached).
"""

from __future__ import annotations

from minivllm.core.block_pool import KVCacheBlock, hash_block_tokens  # noqa: F401  (for you)
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.request import Request


class MyKVCacheManager(KVCacheManager):
    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` (a list, possibly already partly filled) until
        it has one hash per *full* block of ``request.all_token_ids``; a last block with
        fewer than ``self.block_size`` tokens gets no hash (yet: it will when it fills).

        Block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``; its hash is
        ``hash_block_tokens(parent, tokens)`` with ``parent`` the hash of block ``i - 1``
        (``None`` for block 0). Called again as a request grows: hash only the new
        blocks."""
        raise NotImplementedError("MyKVCacheManager.update_block_hashes: extend the hash "
                                  "chain over the full blocks (see its docstring)")

    def find_longest_cache_hit(self, request: Request) -> list[KVCacheBlock]:
        """The hit rule: the cached blocks for the request's leading full blocks, in
        order, from block 0 up to the first block not in the cache (a later block can
        only be reused if everything before it was).

        Never the block that holds the request's last token, even when it is cached:
        that token must run through the model to give logits to sample from. So at most
        ``(request.num_tokens - 1) // self.block_size`` blocks. ``request.block_hashes``
        is up to date when this is called."""
        raise NotImplementedError("MyKVCacheManager.find_longest_cache_hit: walk the hash "
                                  "chain through the cache (see its docstring)")
