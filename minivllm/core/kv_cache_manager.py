"""KVCacheManager: answers "can this request get N more KV slots?" and keeps block tables.

The scheduler asks it three things: which leading blocks of a new request are already
cached (prefix caching), whether a request can grow by ``num_new_tokens`` (allocating
blocks if so), and to free a finished or preempted request's blocks. It owns one block
table per request: the list of physical blocks holding that request's tokens in order,
so token ``t`` lives in ``block_table[t // block_size]`` at offset ``t % block_size``.

Full blocks are hashed as a chain (``hash_block_tokens``) and registered with the pool
as soon as the step that fills them is scheduled: the model runner writes a layer's K/V
for the whole batch before any attention in that layer reads it, so even a request
admitted in the same step can share them.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from minivllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens, like vLLM. Requests resumed after preemption are counted
    apart: their "hits" are their own blocks coming back, not reuse between requests."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 block_pool_cls: type[BlockPool] = BlockPool) -> None:
        """``block_pool_cls`` builds the pool, ``block_pool_cls(num_blocks, enable_caching)``:
        the engine passes the one its config names (``block_pool_cls``, the
        build-it-yourself hook), so a learner's pool runs under the engine's manager."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = block_pool_cls(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    # -- prefix caching: the hash chain and the hit rule (notebook 07) ----------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of its known tokens: block
        ``i``'s hash covers block ``i - 1``'s hash and its own tokens, so equal hashes
        mean equal whole prefixes. A partial last block is not hashed (yet). The request's
        ``cache_salt``, if any, goes into block 0's hash, and so into every hash after it."""
        bs = self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            salt = request.cache_salt if i == 0 else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs], salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks from the request's first token.

        At least the last token is always left to compute, so the request still gets
        logits to sample from. Returns the blocks and the number of tokens they cover.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        if request.scores_prompt:
            # prompt_logprobs need the logits of every prompt position: a cached block would
            # skip them. Such a request reads no hits (its own blocks are still cached).
            return [], 0
        hits = self.find_longest_cache_hit(request)
        num_hit_tokens = len(hits) * self.block_size
        stats = self.prefix_cache_stats
        if request.metrics.num_preemptions:
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens
        else:
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def find_longest_cache_hit(self, request: Request) -> list[KVCacheBlock]:
        """The hit rule: the cached blocks of the request's leading full blocks, from
        the first one up to the first miss, and never the block holding its last token
        (that token must run through the model to give logits to sample from)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- slots ------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens, or return None if the pool can't.

        ``new_computed_blocks`` are prefix-cache hits being adopted on admission; they
        count against the free pool only if they are currently free. The blocks the new
        tokens fill are registered in the prefix cache at once (the step writes them
        before anyone else reads them), unless ``delay_cache_blocks``: a KV connector
        loads them in the background, and nobody may hit them before they arrive
        (:meth:`cache_blocks` registers them then).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that will be full once ``num_tokens`` tokens are computed."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def uncache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Forget the prefix-cache hashes of the request's blocks past its first
        ``num_computed_tokens`` tokens: a step that failed registered them before their
        K/V was written. Blocks before that point (prefix hits among them) keep theirs."""
        first = num_computed_tokens // self.block_size
        for block in self.req_to_blocks.get(request.request_id, [])[first:]:
            self.block_pool.evict_cached_block(block)
        cached = self.num_cached_blocks.get(request.request_id)
        if cached is not None:
            self.num_cached_blocks[request.request_id] = min(cached, first)

    def free_tail_blocks(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past the first ``num_tokens`` tokens (those of
        rejected draft tokens, speculative decoding). Tail blocks are never prefix-cached
        or shared, so they go straight back to the free queue."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if len(blocks) > keep:
            tail, blocks[keep:] = blocks[keep:], []
            self.block_pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        """Release a request's blocks. Tail blocks are freed first so they are evicted
        first: a later request is likelier to share a prefix than a tail."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of block
        tables listing it."""
        self.block_pool.check_invariants()
        counts: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == counts.get(block.block_id, 0), block
