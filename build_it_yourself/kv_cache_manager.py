"""Build it yourself, piece 2: the KV cache manager's ``allocate_slots`` and ``free``.

Read first: notebook 03 (the paged KV cache; block tables), notebook 07 (prefix hits).
Check:      minivllm check kv_cache_manager build_it_yourself/kv_cache_manager.py:MyKVCacheManager
Solution:   minivllm/core/kv_cache_manager.py (the engine's KVCacheManager)

The manager keeps one *block table* per request, ``self.req_to_blocks[request_id]``: the
blocks holding that request's tokens in order, so token ``t`` lives in block
``t // block_size`` of its table at offset ``t % block_size``. It gets blocks from
``self.block_pool`` (``get_num_free_blocks()``, ``get_new_blocks(n)``, ``touch(blocks)``,
``free_blocks(blocks)``: piece 1). The scheduler asks it "can this request grow by N
tokens?" once per request per step.

The invariant (``check_invariants()`` asserts it): each block's ``ref_cnt`` equals the
number of block tables listing it, and the pool's own invariant holds.

Useful: ``cdiv(a, b)`` (ceiling division, from minivllm.core.kv_cache_manager);
``request.num_computed_tokens`` (tokens whose K/V are already in the cache);
``request.request_id``.
"""

from __future__ import annotations

from minivllm.core.block_pool import KVCacheBlock
from minivllm.core.kv_cache_manager import KVCacheManager, cdiv  # noqa: F401  (cdiv: for you)
from minivllm.request import Request


class MyKVCacheManager(KVCacheManager):
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``, or return None
        (changing nothing) if the pool has too few free blocks.

        - The request's table must end up with enough blocks for
          ``num_computed + num_new_tokens`` tokens, where ``num_computed`` is
          ``request.num_computed_tokens`` plus the tokens of ``new_computed_blocks``.
          A table that already has room needs no new block (a decode usually fits).
        - ``new_computed_blocks`` (given once, when a request is admitted) are
          prefix-cache hits: blocks another request computed. Append them to the table
          first and ``touch`` them. They cost no new block, but one that is currently
          free (``ref_cnt == 0``) leaves the free queue when touched, so count those
          against the free blocks too.
        - Check that everything fits *before* changing anything: a request either gets
          all it asked for or nothing.
        - Return the newly allocated blocks (an empty list when none were needed).
        - With prefix caching on (``self.enable_caching``), finish with
          ``self.cache_blocks(request, num_computed + num_new_tokens)``, which
          registers the blocks this step fills so later requests can hit them.
        """
        raise NotImplementedError("MyKVCacheManager.allocate_slots: grow the request's block "
                                  "table, or return None (see its docstring)")

    def free(self, request: Request) -> None:
        """Release every block of the request's table and forget the table (also its
        entry in ``self.num_cached_blocks``). Free the *tail* block first
        (``reversed``): freed blocks are evicted in the order freed, and a later request
        is likelier to share a prompt's beginning than its end. A request with no table
        (never allocated, or freed already) is fine: nothing to do."""
        raise NotImplementedError("MyKVCacheManager.free: give the request's blocks back to "
                                  "the pool, tail first (see its docstring)")
