"""Paged attention, version 1: decode only, one program per (sequence, query head).

What you will learn:
  * how a kernel finds a sequence's keys through its *block table*: logical block ``i``
    of sequence ``s`` lives in physical block ``block_tables[s, i]`` of the cache, so the
    sequence's tokens can be scattered anywhere in memory;
  * the *online softmax*: visiting the keys one block at a time while keeping a running
    maximum ``m``, a running denominator ``l`` and a running weighted sum ``acc``, so
    the whole row of scores never has to exist at once. When a new block raises the
    maximum from ``m`` to ``m_new``, everything accumulated so far is rescaled by
    ``exp(m - m_new)``;
  * grouped-query attention by index arithmetic: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

This is the plain loop a reader can follow line by line, and it is deliberately naive:
no ``tl.dot`` (a decode query is one vector, so scores are a multiply and a sum), and
query heads that share a KV head each load that head's keys again. Version 2
(``paged_attention_v2``) fixes that and handles prefill chunks too.

Constraint: ``head_dim`` and ``block_size`` must be powers of two (``tl.arange``).
Run ``python -m minivllm.kernels.paged_attention_v1`` for the correctness check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton_utils import check_device, check_interpreter_mode

check_interpreter_mode()


@triton.jit
def _paged_attention_v1_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK_SIZE)  # token offsets inside one cache block

    # Decode: sequence `seq` has exactly one query, at row `seq` of the flat batch.
    q = tl.load(query_ptr + seq * stride_qt + head * stride_qh + offs_d).to(tl.float32)

    m = tl.full((), float("-inf"), tl.float32)  # running max of the scores
    l = tl.full((), 0.0, tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros((HEAD_DIM,), tl.float32)  # running sum of exp(score - m) * value
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt + i).to(tl.int64)
        valid = i * BLOCK_SIZE + offs_t < seq_len  # the last block may be partly filled
        k = tl.load(
            key_cache_ptr + block * stride_kb + offs_t[:, None] * stride_ks
            + kv_head * stride_kh + offs_d[None, :],
            mask=valid[:, None], other=0.0,
        ).to(tl.float32)
        v = tl.load(
            value_cache_ptr + block * stride_vb + offs_t[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :],
            mask=valid[:, None], other=0.0,
        ).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE] scores
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)  # rescales what was accumulated under the old max
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / l
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def paged_attention_v1(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention: ``query`` is ``[num_seqs, num_heads, head_dim]``, one token each.

    ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``
    and already hold each sequence's new key/value; ``seq_lens[s]`` counts them.
    """
    num_seqs, num_heads, head_dim = query.shape
    check_device(query)
    _, block_size, num_kv_heads, _ = key_cache.shape
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(
            "paged_attention_v1 is decode-only: it needs exactly one query token per "
            f"sequence, got {num_seqs} query tokens for {seq_lens.shape[0]} sequences "
            "(use paged_attention_v2.paged_attention for prefills and chunks)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    for name, n in (("head_dim", head_dim), ("block_size", block_size)):
        if n & (n - 1):
            raise ValueError(f"paged_attention_v1 needs a power-of-two {name}, got {n}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    out = torch.empty_like(query)
    _paged_attention_v1_kernel[(num_seqs, num_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )
    return out


def _check() -> None:
    """Correctness check against the PyTorch reference, printing the largest error."""
    from minivllm.kernels import reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 8, 16
    seq_lens = torch.tensor([1, 8, 13, 30], dtype=torch.int32, device=device)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    value_cache = torch.randn_like(key_cache)
    # Each sequence gets 4 distinct, shuffled physical blocks.
    block_tables = torch.randperm(num_blocks, device=device).view(4, 4).to(torch.int32)
    query = torch.randn(4, num_heads, head_dim, device=device)
    query_start_loc = torch.arange(5, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    expected = reference.paged_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale
    )
    out = paged_attention_v1(query, key_cache, value_cache, block_tables, seq_lens, scale)
    print(f"paged_attention_v1: max abs error vs reference = {(out - expected).abs().max().item():.3g}")


if __name__ == "__main__":
    _check()
