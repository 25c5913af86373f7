"""Paged attention, version 2: the unified, GQA-aware kernel the engine runs.

What you will learn (read ``paged_attention_v1`` first):
  * *one kernel for every kind of step.* A flat batch mixes whole prompts, prefill
    chunks (several causal queries after context already in the cache) and decodes
    (one query). ``query_start_loc`` says where each sequence's queries start and
    ``seq_lens`` how long each sequence is after this step; query ``i`` of a sequence
    with ``q_len`` new tokens sits at position ``seq_len - q_len + i`` and sees every key
    at or before it. A decode is just ``q_len == 1``.
  * *tiles and ``tl.dot``.* A program takes a tile of ``BLOCK_Q`` query tokens and
    multiplies it by a tile of ``TILE_N`` keys at once, so the tensor cores do the work.
    The scores, the online softmax (same as v1, in float32) and ``p @ V`` are all
    tile-sized.
  * *grouped-query attention done right.* The ``GROUP = num_heads // num_kv_heads``
    query heads that share a KV head are processed by the same program: the tile's rows
    are (query token, head-in-group) pairs, flattened into one ``BLOCK_M`` dimension.
    Each K/V tile is then loaded once for all heads of the group, where v1 loads it
    once per query head.
  * *paging without caring about blocks.* Key ``n`` of a sequence lives in physical
    block ``block_table[n // block_size]`` at offset ``n % block_size``; the kernel looks
    that up per key, so the key tile size is free of the cache's block size (8, 16, 32
    and 64 all work, and tiles stay at least 16 wide as ``tl.dot`` requires).
  * *the causal limit.* A tile of queries never needs keys after its last query, so the
    loop stops there instead of at ``seq_len``.

Grid: ``(num_seqs, num_kv_heads, cdiv(max_q_len, BLOCK_Q))``; programs whose query tile
lies past their sequence's queries exit at once.

Constraints: ``head_dim`` a power of two, at least 16 (``tl.arange`` and ``tl.dot``);
``num_heads`` a multiple of ``num_kv_heads``; float32, float16 or bfloat16. Float32
inputs use full-precision ``tl.dot`` (no TF32), so a float32 engine on Triton matches the
PyTorch path. Run ``python -m minivllm.kernels.paged_attention_v2`` for the check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton_utils import (
    check_device,
    check_interpreter_mode,
    interpreting,
    next_power_of_2,
)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
SUPPORTED_DTYPES = tuple(_TL_DTYPES)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""An 8-bit cache the kernel reads as it is: each K/V tile it loads is converted to the
query's dtype (``_load_kv_tile``); the scales are folded in by the caller
(``minivllm.worker.attention.AttentionBackend.forward``)."""

check_interpreter_mode()


@triton.jit
def _load_kv_tile(key_cache_ptr, value_cache_ptr, table_ptr, offs_n, kv_valid, kv_head, offs_d,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The keys and values at positions ``offs_n`` of one KV head, found through the
    sequence's block table: position ``n`` lives in physical block ``table[n //
    BLOCK_SIZE]`` at offset ``n % BLOCK_SIZE``. Positions past ``kv_valid`` read as zeros.
    This is all the paging there is: the rest of the kernel sees plain tiles."""
    block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k = tl.load(key_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :], mask=kv_valid[:, None], other=0.0)
    v = tl.load(value_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :], mask=kv_valid[:, None], other=0.0)
    return k.to(DOT_DTYPE), v.to(DOT_DTYPE)


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` (base 2, ``-inf`` where masked) and its values ``v``
    into each row's running max ``m_i``, sum ``l_i`` and output ``acc``: version 1's
    online softmax, a tile of keys and a tile of rows at a time."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_v2_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    stride_qt, stride_qh, stride_ot, stride_oh,  # query and out: [tokens, heads, head_dim]
    stride_kb, stride_ks, stride_kh,  # key cache: [blocks, block_size, kv_heads, head_dim]
    stride_vb, stride_vs, stride_vh,  # value cache: the same layout
    stride_bt,  # block tables: [seqs, max_blocks_per_seq]
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows of the tile: power of two >= BLOCK_Q * GROUP
    TILE_N: tl.constexpr,  # keys per loop iteration
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot: the input dtype (see the wrapper)
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # this sequence has fewer query tiles than the longest
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys cached before this step's queries

    # Row m of the tile is query token q_idx, query head `head`.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx  # absolute position: this row sees keys 0..q_pos
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None], other=0.0,
    ).to(DOT_DTYPE)

    # Causal limit: no query in this tile sees past its last query's position.
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    # Every row sees key 0, so the first tile makes m_i finite: no -inf - -inf.
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(0, kv_end, TILE_N):
        offs_n = start_n + tl.arange(0, TILE_N)
        kv_valid = offs_n < kv_end
        k, v = _load_kv_tile(key_cache_ptr, value_cache_ptr, block_tables_ptr + seq * stride_bt,
                             offs_n, kv_valid, kv_head, offs_d, stride_kb, stride_ks, stride_kh,
                             stride_vb, stride_vs, stride_vh, BLOCK_SIZE, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N] fp32
        visible = kv_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, DOT_DTYPE, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def _check_inputs(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Refuse, with a message that says why, what the kernel cannot run."""
    check_device(query)
    num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"paged_attention (Triton) needs a power-of-two head_dim >= 16, got {head_dim}")
    if query.dtype not in SUPPORTED_DTYPES or key_cache.dtype not in (query.dtype, *FP8_CACHE_DTYPES):
        raise ValueError(
            f"paged_attention (Triton) supports float32/float16/bfloat16 with the cache in "
            f"the query's dtype or in fp8, got query {query.dtype} and cache {key_cache.dtype}"
        )


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

    Same signature and contract as ``reference.paged_attention`` (see there for the
    layout), so the engine can swap one for the other.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    _check_inputs(query, key_cache)
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1

    # vLLM passes max_query_len in its metadata; the reference's signature does not, so
    # read it here (one small device->host copy).
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    group = num_heads // num_kv_heads
    # Tile sizes: tl.dot wants every side >= 16. The caps keep shared memory near 50 KB
    # at head_dim 128 (checked by compiling for sm_90): float32 tiles are twice the bytes.
    cap = 32 if query.dtype == torch.float32 else 64
    tile_n = max(16, min(block_size, cap))
    block_m = max(16, next_power_of_2(group), min(cap, next_power_of_2(max_q_len * group)))
    block_q = block_m // group
    dot_dtype = _TL_DTYPES[query.dtype]
    if query.dtype == torch.bfloat16 and interpreting():
        # The interpreter multiplies bfloat16 bit patterns in tl.dot (triton#11584);
        # there, feed the dots float32. Compiled kernels keep bfloat16 operands.
        dot_dtype = tl.float32
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_q_len, block_q))
    _paged_attention_v2_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        scale * 1.4426950408889634,  # log2(e)
        *query.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )
    return out


def _check() -> None:
    """Correctness check against the PyTorch reference, printing the largest error."""
    from minivllm.kernels import reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 32, 16, 12
    # A whole prompt, a chunk after 13 cached tokens, and two decodes.
    q_lens, seq_lens_list = [5, 7, 1, 1], [5, 20, 1, 32]
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device)[:8].view(4, 2).to(torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, device=device)
    query_start_loc = torch.tensor([0, 5, 12, 13, 14], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    err = (paged_attention(*args) - reference.paged_attention(*args)).abs().max().item()
    print(f"paged_attention_v2: max abs error vs reference = {err:.3g}")


if __name__ == "__main__":
    _check()
