"""Build it yourself, piece 1: the block pool's free queue and reference counts.

Read first: notebook 03 (the paged KV cache) and, for cached blocks, notebook 07.
Check:      minivllm check block_pool build_it_yourself/block_pool.py:MyBlockPool
Solution:   minivllm/core/block_pool.py (the engine's BlockPool)

The KV cache is ``num_blocks`` fixed-size blocks made once. The pool hands blocks out and
takes them back; it never touches tensors, only :class:`KVCacheBlock` records
(``block_id``, ``ref_cnt``, ``block_hash``). ``MyBlockPool`` inherits the engine's
``__init__`` (which makes ``self.blocks`` and fills ``self.free_block_queue``), the prefix
cache's lookup and the invariant check; you write the three methods below.

The invariant to keep (``check_invariants()`` asserts it after your methods run):

    every block is either in ``self.free_block_queue`` with ``ref_cnt == 0``, or listed
    by some request (``ref_cnt > 0``) and not in the queue; never both, never neither.

``self.free_block_queue`` is an ``OrderedDict`` from block id to block: its front (first
item) is the block to hand out next. ``popitem(last=False)`` takes the front,
``queue[block_id] = block`` appends at the back, ``del queue[block_id]`` removes from the
middle, all in O(1).
"""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.core.block_pool import BlockPool, KVCacheBlock


class MyBlockPool(BlockPool):
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue, each with ``ref_cnt = 1``,
        in the order taken.

        - Asking for more blocks than are free raises ``RuntimeError`` and takes none
          (the KV cache manager asks ``get_num_free_blocks()`` first, so this is a bug
          guard, not a normal path).
        - A block taken from the queue may still hold a cached prefix (prefix caching
          keeps freed blocks findable until they are reused). It is about to be
          overwritten, so forget its hash first: ``self.evict_cached_block(block)``.

        Hint: the front of the queue is the block freed longest ago (least recently
        used): that is the one whose cached content is least likely to be wanted again.
        """
        raise NotImplementedError("MyBlockPool.get_new_blocks: take n blocks from the front "
                                  "of the free queue (see its docstring)")

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts sharing these blocks (prefix-cache hits): add one reference
        to each. A block that was free (``ref_cnt == 0``) is owned again: take it out of
        the free queue, wherever it is in it."""
        raise NotImplementedError("MyBlockPool.touch: count one more user of each block "
                                  "(see its docstring)")

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. A block whose count reaches zero joins the
        *back* of the free queue, in the order given (the manager gives a request's tail
        block first, so it is evicted first). A count below zero is a double free: a bug,
        fail loudly (``assert``)."""
        raise NotImplementedError("MyBlockPool.free_blocks: drop one reference from each "
                                  "block (see its docstring)")
