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

from dataclasses import dataclass

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

    A negative slot means "do not store" (vLLM uses -1 for padding tokens). An 8-bit
    cache is written as bytes (PyTorch's CPU ``index_copy_`` has no fp8 version); the
    values arrive already rounded to it (``minivllm.worker.kv_cache_quant``).
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for new, cache in ((key, key_cache), (value, value_cache)):
        new = new.to(cache.dtype)
        if cache.element_size() == 1:
            new, cache = new.view(torch.uint8), cache.view(torch.uint8)
        cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, new)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, made contiguous: ``[seq_len, H_kv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:seq_len]


@dataclass
class DecodeGroup:
    """Decoding sequences attended in one batched SDPA call over gathered, padded K/V."""

    rows: torch.Tensor | None
    """Their query rows in the flat batch (None: every row, in order)."""
    slots: torch.Tensor
    """``[batch * length]`` cache slot of every (sequence, position) up to ``length``."""
    valid: torch.Tensor
    """``[batch, 1, 1, length]`` True where the position is inside the sequence."""

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def length(self) -> int:
        return self.valid.shape[-1]


@dataclass
class AttentionPlan:
    """Everything about a step's batch that is the same in every layer, worked out once
    per step instead of once per layer (vLLM's attention backends have a metadata
    builder for the same reason). :func:`paged_attention` makes one when not given one."""

    decode_groups: list[DecodeGroup]
    prefills: list[tuple[int, int, int, int]]
    """(sequence, first query row, query length, seq_len) of every multi-token sequence."""
    workspace: torch.Tensor | None = None
    """Scratch memory the decode groups' K and V are gathered into, reused by every layer
    (None, or too small: each gather allocates). A 32-request decode gathers megabytes
    twice per layer; allocated afresh each time, glibc hands such blocks back to the
    kernel and takes them again, and every page faults on first touch, which made the
    gathers several times slower than the copy itself on the 2-core CPU this was
    measured on (``minivllm bench roofline``, the decode steps)."""

    def workspace_size(self, row_width: int) -> int:
        """Elements the largest decode group needs for its K and V rows of ``row_width``."""
        return 2 * row_width * max((g.slots.numel() for g in self.decode_groups), default=0)


def plan_attention(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    min_group_tokens: int = 256,
) -> AttentionPlan:
    """Sort the sequences into prefills (one SDPA call each) and groups of decodes.

    Decodes are batched: K/V are gathered as ``[batch, length]`` up to the longest
    context in the group, so a short context next to a long one costs the long one's
    reads. Sorting decodes by length and cutting the sorted list where that padding
    would exceed ``min_group_tokens`` gathered tokens makes a few groups of similar
    lengths: fewer bytes to copy and attend over, for one more SDPA call per group.
    """
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    lens = seq_lens.tolist()
    prefills = [(s, starts[s], q, lens[s]) for s, q in enumerate(q_lens) if q > 1]
    decodes = [s for s, q in enumerate(q_lens) if q == 1]
    groups = []
    if decodes:
        by_len = sorted(decodes, key=lambda s: lens[s])
        cuts = _cut_by_length([lens[s] for s in by_len], min_group_tokens)
        if len(cuts) == 2:  # one group: keep batch order (and skip the row shuffle if all decode)
            groups.append(_decode_group(decodes, lens, block_tables, query_start_loc, block_size,
                                        in_order=len(decodes) == len(q_lens)))
        else:
            for a, b in zip(cuts, cuts[1:]):
                groups.append(_decode_group(by_len[a:b], lens, block_tables, query_start_loc,
                                            block_size, in_order=False))
    return AttentionPlan(groups, prefills)


def _cut_by_length(sorted_lens: list[int], min_group_tokens: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` of groups of ascending lengths. Walking down from the
    longest, a new group starts when padding everything so far to the current group's
    longest would waste more than ``min_group_tokens`` positions."""
    n = len(sorted_lens)
    cuts = [n]
    top = sorted_lens[-1]
    used = 0
    for i in range(n - 1, -1, -1):
        waste = (cuts[-1] - i) * top - used - sorted_lens[i]
        if waste > min_group_tokens:
            cuts.append(i + 1)
            top, used = sorted_lens[i], 0
        used += sorted_lens[i]
    cuts.append(0)
    return cuts[::-1]  # a group's first (longest) member never starts a new one: no repeats


def _decode_group(seqs: list[int], lens: list[int], block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, block_size: int, in_order: bool) -> DecodeGroup:
    dev = block_tables.device
    length = max(lens[s] for s in seqs)
    idx = torch.tensor(seqs, device=dev)
    tables = block_tables if in_order else block_tables[idx]
    # The slot of every (sequence, position) up to the longest context; one
    # index_select (far cheaper on a CPU than advanced indexing) then gathers K and V.
    # Positions past a sequence's end are masked out of the softmax, but 0 * NaN would
    # still poison the sum if they read an unwritten slot, so they point at the
    # sequence's own position 0, which always holds a real key.
    pos = torch.arange(length, device=dev)
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    valid = pos < torch.tensor([lens[s] for s in seqs], device=dev).unsqueeze(1)
    slots = torch.where(valid, slots, slots[:, :1]).reshape(-1)
    rows = None if in_order else query_start_loc[idx].long()
    return DecodeGroup(rows, slots, valid[:, None, None, :])


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
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
        plan: this batch's :func:`plan_attention` (the engine makes it once per step).

    Returns ``[num_tokens, num_heads, head_dim]``. Grouped-query attention is handled by
    letting ``num_heads`` be a multiple of ``num_kv_heads``. An 8-bit cache is read as it
    is and converted to the query's dtype after the gather (its scales are the caller's:
    ``minivllm.worker.attention.AttentionBackend.forward``).

    Decodes (one query each) are batched into SDPA calls over gathered, padded K/V;
    sequences with several queries (prefills and prefill chunks) get one call each.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if plan is None:
        plan = plan_attention(block_tables, query_start_loc, seq_lens, key_cache.shape[1])
    # One row per cached token (all KV heads side by side): index_select copies rows,
    # and long rows copy much faster than [num_kv_heads, head_dim] slices.
    flat_k = key_cache.view(-1, num_kv_heads * head_dim)
    flat_v = value_cache.view(-1, num_kv_heads * head_dim)
    out = None
    workspace = plan.workspace
    if workspace is not None and workspace.numel() < plan.workspace_size(flat_k.shape[1]):
        workspace = None  # too small for this batch: allocate instead
    for g in plan.decode_groups:
        shape = (g.batch, g.length, num_kv_heads, head_dim)
        k, v = _gather_decode_kv(g, flat_k, flat_v, workspace, query.dtype)
        k = k.view(shape).transpose(1, 2)  # [B, H_kv, L, D]
        v = v.view(shape).transpose(1, 2)
        # The query heads that share a KV head go in as that head's queries ([B, H_kv,
        # H / H_kv, D], one position each, so no causal mask among them): SDPA then reads
        # each gathered key and value once rather than once per query head.
        q = (query if g.rows is None else query[g.rows]).view(g.batch, num_kv_heads, -1, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.valid, scale=scale).view(g.batch, num_heads, head_dim)
        if g.rows is None:
            return o  # every sequence decodes: nothing else to do
        if out is None:
            out = torch.empty_like(query)
        out[g.rows] = o

    if out is None:
        out = torch.empty_like(query)
    _attend_prefills(out, query, key_cache, value_cache, block_tables, plan, scale)
    return out


def _gather_decode_kv(g: DecodeGroup, flat_k: torch.Tensor, flat_v: torch.Tensor,
                      workspace: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group's keys and values in ``dtype``, one row per (sequence, position),
    copied into the plan's scratch when there is one (K in its first half, V in its
    second), so a step allocates nothing but, from an 8-bit cache, the gathered bytes."""
    if workspace is None:
        return flat_k.index_select(0, g.slots).to(dtype), flat_v.index_select(0, g.slots).to(dtype)
    kv = workspace[: 2 * g.slots.numel() * flat_k.shape[1]].view(2, -1, flat_k.shape[1])
    if flat_k.dtype != workspace.dtype:  # an 8-bit cache: gather the bytes, convert into the scratch
        return kv[0].copy_(flat_k.index_select(0, g.slots)), kv[1].copy_(flat_v.index_select(0, g.slots))
    return (torch.index_select(flat_k, 0, g.slots, out=kv[0]),
            torch.index_select(flat_v, 0, g.slots, out=kv[1]))


def _attend_prefills(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_tables: torch.Tensor,
                     plan: AttentionPlan, scale: float) -> None:
    """The sequences with several queries (whole prompts and prefill chunks), one SDPA
    call each, written into their rows of ``out``."""
    gqa = query.shape[1] != key_cache.shape[2]
    for s, start, q_len, seq_len in plan.prefills:
        q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
        k = gather_kv(key_cache, block_tables[s], seq_len).to(query.dtype).transpose(0, 1)
        v = gather_kv(value_cache, block_tables[s], seq_len).to(query.dtype).transpose(0, 1)
        if q_len == seq_len:  # a whole prompt: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # a chunk after cached context: query i sits at position seq_len - q_len + i
            pos_q = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= pos_q[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + q_len] = o.transpose(0, 1)
