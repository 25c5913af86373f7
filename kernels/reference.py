"""Paged attention in plain PyTorch: the reference every kernel is checked against.

This is also the attention path the engine runs on a CPU (``attention_backend="torch"``):
the code a reader checks the Triton kernels against is the code that serves tokens.

The paged KV cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``t`` of a sequence lives in physical block ``block_table[t //
block_size]`` at offset ``t % block_size``; its flat *slot* is ``block_id * block_size +
offset``. A step's batch is flat: the query tokens of every scheduled sequence are
concatenated, ``query_start_loc`` (vLLM's ``cu_seqlens_q``) marks where each sequence's
tokens start, and ``seq_lens`` is each sequence's length *after* this step (cached
context plus new tokens). A sequence's new tokens are its last ``q_len`` positions, so
query ``i`` of sequence ``s`` sits at position ``seq_lens[s] - q_len + i`` and may attend
to every key at or before it. Prefill (no context), a prefill chunk (context plus many
queries) and a decode (context plus one query) are all the same formula.

Notebook 05 walks through this file next to the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    A negative slot means "do not store" (vLLM uses -1 for padding tokens).
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, made contiguous: ``[seq_len, H_kv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:seq_len]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flat batch of queries over a paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the new tokens of all sequences.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            already holding this step's keys and values (``reshape_and_cache`` first).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` physical block ids.
        query_start_loc: ``[num_seqs + 1]`` offsets of each sequence's queries.
        seq_lens: ``[num_seqs]`` context length of each sequence including new tokens.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns ``[num_tokens, num_heads, head_dim]``. Grouped-query attention is handled by
    letting ``num_heads`` be a multiple of ``num_kv_heads``.

    Decodes (one query each) are batched into one SDPA call over gathered, padded K/V;
    sequences with several queries (prefills and prefill chunks) get one call each.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(query)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    lens = seq_lens.tolist()

    decodes = [s for s, q in enumerate(q_lens) if q == 1]
    if decodes:
        all_decodes = len(decodes) == len(q_lens)
        idx = torch.tensor(decodes, device=query.device)
        block_size = key_cache.shape[1]
        max_len = max(lens[s] for s in decodes)
        tables = block_tables if all_decodes else block_tables[idx]
        # The slot of every (sequence, position) up to the longest context, then one
        # index_select (far cheaper on a CPU than advanced indexing) gathers K and V as
        # [B, H_kv, L, D]. Positions past a sequence's end are masked out of the softmax,
        # but 0 * NaN would still poison the sum if they read an unwritten slot, so they
        # point at the sequence's own position 0, which always holds a real key.
        pos = torch.arange(max_len, device=query.device)
        lens_t = seq_lens[idx].unsqueeze(1)
        slots = tables[:, pos // block_size].long() * block_size + pos % block_size
        valid = pos < lens_t
        slots = torch.where(valid, slots, slots[:, :1]).reshape(-1)
        shape = (len(decodes), max_len, num_kv_heads, head_dim)
        k = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(shape).transpose(1, 2)
        v = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(shape).transpose(1, 2)
        rows = query_start_loc[idx].long()
        q = (query if all_decodes else query[rows]).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=gqa
        ).squeeze(2)
        if all_decodes:
            return o
        out[rows] = o

    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len = lens[s]
        q = query[starts[s] : starts[s] + q_len].transpose(0, 1)  # [H, q_len, D]
        k = gather_kv(key_cache, block_tables[s], seq_len).transpose(0, 1)
        v = gather_kv(value_cache, block_tables[s], seq_len).transpose(0, 1)
        if q_len == seq_len:  # a whole prompt: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # a chunk after cached context: query i sits at position seq_len - q_len + i
            pos_q = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= pos_q[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[starts[s] : starts[s] + q_len] = o.transpose(0, 1)
    return out
