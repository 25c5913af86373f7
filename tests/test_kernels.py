"""The Triton kernels (and the PyTorch reference) against SDPA on contiguous K/V.

Every test builds the same kind of batch (``paged_batches.make_batch``): sequences whose
keys and values are made contiguously, then scattered into a paged cache through
shuffled block tables, with NaN in every slot nobody wrote. The expected output is
``torch.nn.functional.scaled_dot_product_attention`` in float32 on the contiguous data.
The attention backend under test in the engine (the reference by default, a learner's
under ``minivllm check attention``) is checked the same way in test_attention.py.

On a CPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before they are imported), which costs about 3 ms per program
instance and loop iteration: shapes here are tiny on purpose.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from paged_batches import (
    BLOCK_SIZES,
    DEVICE,
    DTYPES,
    GQA,
    TOL,
    Batch,
    assert_matches,
    batches,
    make_batch,
    mixed,
    sdpa_expected,
)

pytest.importorskip("triton")

from minivllm.kernels import reference  # noqa: E402
from minivllm.kernels.paged_attention_v1 import paged_attention_v1  # noqa: E402
from minivllm.kernels.paged_attention_v2 import paged_attention  # noqa: E402
from minivllm.kernels.triton_reshape_and_cache import reshape_and_cache  # noqa: E402
from minivllm.kernels.triton_utils import triton_available  # noqa: E402

# ---- the reference is the engine's CPU path (test_attention.py checks it against SDPA) ----


@pytest.mark.parametrize("workspace", ["none", "NaN-filled", "too small"])
@pytest.mark.parametrize("q_lens", [[1] * 7, [1, 1, 5, 1, 1, 7, 1]])
@pytest.mark.parametrize("min_group_tokens", [0, 64, 10**9])
def test_reference_decode_groups(q_lens, min_group_tokens, workspace):
    """Decodes of very different lengths, batched into one SDPA call or split by length
    into several (sorted, so their query rows come back shuffled), give the same output,
    whether K/V are gathered into fresh tensors or into a reused scratch that holds stale
    (NaN) data from before, and a scratch too small is not written past its end."""
    seq_lens = [3, 70, 5, 16, 33, 120, 40]
    b = make_batch(q_lens, seq_lens, 6, 2, 16, 8)
    plan = reference.plan_attention(b.block_tables, b.query_start_loc, b.seq_lens, 8, min_group_tokens)
    if workspace != "none":
        size = plan.workspace_size(2 * 16) - (1 if workspace == "too small" else 0)
        plan.workspace = torch.full((size,), float("nan"))
    assert sum(g.batch for g in plan.decode_groups) == q_lens.count(1)
    assert len(plan.prefills) == len(q_lens) - q_lens.count(1)
    if min_group_tokens == 10**9:
        assert len(plan.decode_groups) == 1
    if min_group_tokens == 0:  # no padding allowed: one group per distinct length
        assert len(plan.decode_groups) == len({n for n, q in zip(seq_lens, q_lens) if q == 1})
    out = reference.paged_attention(*b.args(), plan=plan)
    assert_matches(out, sdpa_expected(b), torch.float32, f"reference, {len(plan.decode_groups)} decode groups")
    if workspace == "too small":
        assert plan.workspace.isnan().all()


# ---- KV store ---------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reshape_and_cache_writes_exactly_its_slots(block_size, cache_dtype):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 4, 3, 24, 9  # head_dim need not be 2^k
    # Keys as a strided view, the way they come out of a fused QKV projection.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=g).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    slots[[2, 5]] = -1  # padding tokens are not stored
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    sentinel = -3.0
    kc = torch.full(shape, sentinel, dtype=cache_dtype, device=DEVICE)
    vc = torch.full(shape, sentinel, dtype=cache_dtype, device=DEVICE)
    reshape_and_cache(key, value, kc, vc, slots)

    written = slots[slots >= 0]
    for cache, src in ((kc, key), (vc, value)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        torch.testing.assert_close(flat[written], src[slots >= 0].to(cache_dtype), atol=0, rtol=0)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[written] = False
        assert (flat[untouched] == sentinel).all()

    ref_k = torch.full(shape, sentinel, dtype=cache_dtype, device=DEVICE)
    ref_v = ref_k.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_reshape_and_cache_int32_slots_and_empty_batch():
    kc = torch.zeros(2, 8, 1, 16, device=DEVICE)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 1, 16, device=DEVICE)
    reshape_and_cache(key, -key, kc, vc, torch.tensor([15, 0, 7], dtype=torch.int32, device=DEVICE))
    assert torch.equal(kc.view(-1, 1, 16)[[15, 0, 7]], key)
    assert torch.equal(vc.view(-1, 1, 16)[[15, 0, 7]], -key)
    empty = torch.empty(0, 1, 16, device=DEVICE)
    reshape_and_cache(empty, empty, kc, vc, torch.empty(0, dtype=torch.int64, device=DEVICE))


# ---- v1: decode only --------------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_v1_decode(block_size, num_heads, num_kv_heads):
    seq_lens = [1, block_size, 2 * block_size + 3, 3 * block_size - 1]
    b = make_batch([1] * 4, seq_lens, num_heads, num_kv_heads, 16, block_size)
    out = paged_attention_v1(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale)
    assert_matches(out, sdpa_expected(b), torch.float32, "v1 vs SDPA")
    assert_matches(out, reference.paged_attention(*b.args()), torch.float32, "v1 vs reference")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_v1_half_precision(dtype):
    b = make_batch([1, 1, 1], [1, 16, 37], 8, 2, 32, 16, dtype)
    out = paged_attention_v1(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale)
    assert_matches(out, sdpa_expected(b), dtype, f"v1 {dtype}")


def test_v1_rejects_prefill():
    b = make_batch([3, 1], [3, 9])
    with pytest.raises(ValueError, match="decode-only"):
        paged_attention_v1(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale)


# ---- v2: unified prefill chunks + decodes, GQA-aware ------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_v2_mixed_batch(block_size, num_heads, num_kv_heads):
    b = make_batch(*mixed(block_size), num_heads, num_kv_heads, 16, block_size)
    out = paged_attention(*b.args())
    assert_matches(out, sdpa_expected(b), torch.float32, "v2 vs SDPA")
    assert_matches(out, reference.paged_attention(*b.args()), torch.float32, "v2 vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_v2_dtypes_and_head_dims(head_dim, dtype):
    b = make_batch([1, 6, 1], [1, 21, 40], 8, 2, head_dim, 16, dtype, seed=head_dim)
    assert_matches(paged_attention(*b.args()), sdpa_expected(b), dtype, f"v2 {dtype} d={head_dim}")


def test_v2_long_chunk_spans_query_tiles():
    # GQA 4 packs 16 query tokens per tile: 40 queries after 10 cached tokens take 3
    # tiles, each stopping at its own causal limit; the decode exits after tile 0.
    b = make_batch([40, 1], [50, 23], 8, 2, 16, 8)
    assert_matches(paged_attention(*b.args()), sdpa_expected(b), torch.float32, "v2 long chunk")


def test_v2_agrees_with_v1_on_decode():
    b = make_batch([1] * 5, [1, 7, 16, 33, 64], 6, 2, 32, 16)
    v1 = paged_attention_v1(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale)
    assert_matches(paged_attention(*b.args()), v1, torch.float32, "v2 vs v1")


@settings(max_examples=25, deadline=None)
@given(batches())
def test_v2_random_batches(b: Batch):
    out = paged_attention(*b.args())
    torch.testing.assert_close(out, sdpa_expected(b), **TOL[torch.float32])


@pytest.mark.parametrize("head_dim", [8, 24])
def test_v2_rejects_unsupported_head_dim(head_dim):
    b = make_batch([1], [4], head_dim=head_dim)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_attention(*b.args())


def test_v2_rejects_unsupported_dtype():
    b = make_batch([1], [4], dtype=torch.float64)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        paged_attention(*b.args())


def test_triton_available():
    assert triton_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_benchmark_exits_cleanly_without_cuda(monkeypatch, capsys):
    from minivllm.kernels import bench_paged_attention

    monkeypatch.setattr("sys.argv", ["bench_paged_attention"])
    bench_paged_attention.main()
    assert "No CUDA device" in capsys.readouterr().out


# ---- in the engine: the attention backends ------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_backend_stores_then_attends(backend):
    """The model runner's view of a kernel pair: one ``forward`` per layer stores this
    step's keys and values at ``slot_mapping``, then attends over the cache."""
    from minivllm.worker.attention import AttentionMetadata, get_attn_backend

    bs = 8
    q_lens, seq_lens = mixed(bs)
    b = make_batch(q_lens, seq_lens, 6, 2, 16, bs)
    slots, new_keys, new_values = [], [], []
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        slots.append(b.block_tables[s, pos // bs].long() * bs + pos % bs)
        new_keys.append(b.keys[s][seq_len - q_len :])
        new_values.append(b.values[s][seq_len - q_len :])
    slot_mapping = torch.cat(slots)
    for cache in (b.key_cache, b.value_cache):  # the cache holds the context only
        cache.view(-1, *cache.shape[2:])[slot_mapping] = float("nan")

    attn = get_attn_backend(backend, [(b.key_cache, b.value_cache)], torch.device(DEVICE))
    common = AttentionMetadata(slot_mapping, b.block_tables, b.query_start_loc, b.seq_lens)
    out = attn.forward(0, b.query, torch.cat(new_keys), torch.cat(new_values), attn.build_metadata(common), b.scale)
    assert_matches(out, sdpa_expected(b), torch.float32, f"{backend} backend")
    stored = b.key_cache.view(-1, *b.key_cache.shape[2:])[slot_mapping]
    assert torch.equal(stored, torch.cat(new_keys))
