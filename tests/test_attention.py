"""The attention backend the engine runs, against PyTorch's SDPA on contiguous K/V.

One call per layer (``AttentionBackend.forward``) stores this step's new keys and values
through ``slot_mapping`` and attends over the paged cache through the block tables,
causally: a prompt, a prompt chunk after cached context, and a decode are one formula.
The backend comes from ``components`` (tests/conftest.py): the PyTorch reference
(``minivllm/kernels/reference.py``, the engine's CPU path) by default, or a learner's under
``minivllm check attention`` (build_it_yourself/attention.py). No Triton needed.
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

from minivllm.worker.attention import AttentionMetadata

pytestmark = pytest.mark.checks("attention")


def run_backend(components, b: Batch) -> torch.Tensor:
    """What the model runner does in one layer: the cache holds each sequence's context
    (its earlier tokens); the step's new keys and values go in through ``forward``."""
    block_size = b.key_cache.shape[1]
    q_lens = (b.query_start_loc[1:] - b.query_start_loc[:-1]).tolist()
    slots, new_keys, new_values = [], [], []
    for s, (q_len, seq_len) in enumerate(zip(q_lens, b.seq_lens.tolist())):
        pos = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        slots.append(b.block_tables[s, pos // block_size].long() * block_size + pos % block_size)
        new_keys.append(b.keys[s][seq_len - q_len:])
        new_values.append(b.values[s][seq_len - q_len:])
    slot_mapping = torch.cat(slots)
    for cache in (b.key_cache, b.value_cache):  # the new tokens' slots are not written yet
        cache.view(-1, *cache.shape[2:])[slot_mapping] = float("nan")
    backend = components.attention_backend([(b.key_cache, b.value_cache)], torch.device(DEVICE))
    metadata = backend.build_metadata(
        AttentionMetadata(slot_mapping, b.block_tables, b.query_start_loc, b.seq_lens))
    out = backend.forward(0, b.query, torch.cat(new_keys), torch.cat(new_values), metadata, b.scale)
    stored = b.key_cache.view(-1, *b.key_cache.shape[2:])[slot_mapping]
    assert torch.equal(stored, torch.cat(new_keys).to(stored.dtype)), \
        "the new keys must be written to their slot_mapping slots"
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_backend_matches_sdpa(components, block_size, num_heads, num_kv_heads, dtype):
    """A mixed batch: a 1-token prompt, decodes at and off block boundaries, a whole
    prompt, chunks after cached context (notebook 05)."""
    b = make_batch(*mixed(block_size), num_heads, num_kv_heads, 16, block_size, dtype)
    assert_matches(run_backend(components, b), sdpa_expected(b), dtype, "backend")


def test_a_prompt_attends_causally(components):
    """One 6-token prompt: each query sees itself and the tokens before it, no later one."""
    b = make_batch([6], [6], 2, 2, 16, 4)
    out = run_backend(components, b)
    assert torch.isfinite(out).all(), "NaN in the output: a slot outside the sequence was read"
    torch.testing.assert_close(out, sdpa_expected(b), **TOL[torch.float32],
                               msg=lambda m: "a prompt's query i must see keys 0..i only. " + m)


@settings(max_examples=25, deadline=None)
@given(batches())
def test_backend_random_batches(components, b: Batch):
    torch.testing.assert_close(run_backend(components, b), sdpa_expected(b), **TOL[torch.float32])
