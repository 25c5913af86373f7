"""Paged batches for the attention tests (test_attention.py, test_kernels.py).

Sequences whose keys and values are made contiguously, then scattered into a paged cache
through shuffled block tables. Slots nobody wrote are NaN, and so is a spare block used
as block-table padding, so a kernel that reads one slot too many fails loudly instead of
by a rounding error. The expected output is ``torch.nn.functional.scaled_dot_product_attention``
in float32 on the contiguous data: PyTorch, a reference nobody here wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZES = [8, 16, 32, 64]
GQA = [(2, 2), (6, 2), (8, 2)]  # (num_heads, num_kv_heads): ratios 1, 3 and 4
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, contiguous [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float

    def args(self) -> tuple:
        return (
            self.query, self.key_cache, self.value_cache, self.block_tables,
            self.query_start_loc, self.seq_lens, self.scale,
        )


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """A flat batch whose sequences own shuffled, non-contiguous cache blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g)
    poison = int(perm[-1])  # an unowned block: block-table padding points at it
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(blocks) + 1), poison, dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        block_tables[s, :nb] = ids.to(torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = ids[pos // block_size] * block_size + pos % block_size
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k.to(DEVICE))
        values.append(v.to(DEVICE))
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), block_tables.to(DEVICE),
        query_start_loc.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        keys, values, head_dim**-0.5,
    )


def sdpa_expected(b: Batch) -> torch.Tensor:
    """Float32 SDPA per sequence on contiguous K/V; query i sits at seq_len - q_len + i."""
    group = b.query.shape[1] // b.key_cache.shape[2]
    starts = b.query_start_loc.tolist()
    outs = []
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        q = b.query[starts[s] : starts[s + 1]].float().transpose(0, 1)  # [H, q_len, D]
        k = b.keys[s].float().transpose(0, 1).repeat_interleave(group, 0)
        v = b.values[s].float().transpose(0, 1).repeat_interleave(group, 0)
        pos_q = torch.arange(seq_len - q.shape[1], seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= pos_q[:, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=b.scale).transpose(0, 1))
    return torch.cat(outs)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    err = (out.float() - expected.float()).abs().max().item()
    print(f"{what}: max abs error {err:.3g}")
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


def mixed(block_size: int) -> tuple[list[int], list[int]]:
    """q_lens, seq_lens: a 1-token prompt, decodes at and off block boundaries, a whole
    prompt, a chunk after context crossing a block boundary, a chunk ending on one."""
    bs = block_size
    return [1, 1, 1, 5, 7, bs - 1], [1, 2 * bs, bs + 3, 5, bs + 5, 2 * bs]


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    """Random mixes of prompts, chunks and decodes over random cache shapes."""
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    num_heads, num_kv_heads = draw(st.sampled_from(GQA))
    q_lens, seq_lens = [], []
    for _ in range(draw(st.integers(1, 4))):
        seq_len = draw(st.integers(1, 70))
        q_lens.append(draw(st.sampled_from([1, seq_len, draw(st.integers(1, seq_len))])))
        seq_lens.append(seq_len)
    return make_batch(q_lens, seq_lens, num_heads, num_kv_heads, 16, block_size, seed=draw(st.integers(0, 99)))
