"""One deliberately wrong implementation of each build-it-yourself piece, each a small
and plausible mistake, so test_build_it_yourself.py shows that `minivllm check` fails
them: checks that cannot fail would prove nothing."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from minivllm.core.block_pool import BlockPool, hash_block_tokens
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.kernels.reference import gather_kv
from minivllm.sample.sampler import Sampler
from minivllm.worker.attention import TorchAttentionBackend


class LifoBlockPool(BlockPool):
    """Freed blocks go to the front of the queue: a stack, not least-recently-freed first."""

    def free_blocks(self, ordered_blocks):
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block
                self.free_block_queue.move_to_end(block.block_id, last=False)


class HeadFirstKVCacheManager(KVCacheManager):
    """Frees a request's first block first, so a shared prefix is evicted before a tail."""

    def free(self, request):
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(blocks)


class UnchunkedScheduler(Scheduler):
    """Never cuts a prompt into chunks: a long prompt waits for a whole budget."""

    def schedule(self):
        chunked, self.enable_chunked_prefill = self.enable_chunked_prefill, False
        try:
            return super().schedule()
        finally:
            self.enable_chunked_prefill = chunked


class OldestVictimScheduler(Scheduler):
    """Preempts the oldest running request instead of the most recently admitted."""

    def preempt_victim(self):
        self.running.insert(len(self.running) - 1, self.running.pop(0))  # oldest to the end
        return super().preempt_victim()


class UnchainedKVCacheManager(KVCacheManager):
    """Hashes each block on its own tokens, forgetting its parent: not a chain."""

    def update_block_hashes(self, request):
        bs, hashes = self.block_size, request.block_hashes
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            hashes.append(hash_block_tokens(None, request.all_token_ids[i * bs:(i + 1) * bs]))


class UnmaskedAttentionBackend(TorchAttentionBackend):
    """Every query attends to its sequence's every key: no causal mask."""

    def attend(self, query, key_cache, value_cache, metadata, scale):
        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        for s, seq_len in enumerate(metadata.seq_lens.tolist()):
            q = query[starts[s]:starts[s + 1]].transpose(0, 1)
            k = gather_kv(key_cache, metadata.block_tables[s], seq_len).transpose(0, 1)
            v = gather_kv(value_cache, metadata.block_tables[s], seq_len).transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, scale=scale,
                                               enable_gqa=q.shape[0] != k.shape[0])
            out[starts[s]:starts[s + 1]] = o.transpose(0, 1)
        return out


class TopKIgnoringSampler(Sampler):
    """Applies temperature and top-p but forgets top-k."""

    def sample(self, logits, p, generator):
        return super().sample(logits, dataclasses.replace(p, top_k=0), generator)
