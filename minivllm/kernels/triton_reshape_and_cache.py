"""Storing new keys and values into the paged KV cache, in Triton.

What you will learn:
  * how a *slot mapping* turns a flat batch of new tokens into scattered writes:
    token ``i`` goes to slot ``slot_mapping[i] = block_id * block_size + offset``;
  * one program per token, each copying that token's ``num_kv_heads x head_dim`` values
    as one flat vector (any head_dim works: the vector is padded to a power of two and
    masked);
  * why a negative slot is skipped: vLLM marks padding tokens with ``-1``.

The plain-PyTorch version is ``reference.reshape_and_cache``; this kernel has its exact
signature so the engine can swap one for the other. Run ``python -m
minivllm.kernels.triton_reshape_and_cache`` for the correctness check (on a CPU, with
``TRITON_INTERPRET=1`` set before import; see ``triton_utils``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton_utils import check_device, check_interpreter_mode, next_power_of_2

check_interpreter_mode()


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,  # key_cache viewed as [num_slots, num_kv_heads, head_dim]
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= NUM_KV_HEADS * HEAD_DIM
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    kc = key_cache_ptr + slot * stride_kc_slot + head * stride_kc_h + dim
    vc = value_cache_ptr + slot * stride_vc_slot + head * stride_vc_h + dim
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    Same contract as ``reference.reshape_and_cache``: the caches are
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` and are written in place;
    negative slots are skipped. ``key``/``value`` may be strided views (e.g. slices of a
    fused QKV projection) as long as the last dimension is contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    check_device(key_cache)
    if num_tokens == 0:
        return
    if key.dtype != key_cache.dtype:
        # Convert in PyTorch (round-to-nearest-even, like the reference); the interpreter's
        # float32->bfloat16 and float32->fp8 casts truncate instead, which would make the
        # two disagree (an 8-bit cache's values arrive already rounded: kv_cache_quant).
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    # The cache's (block, offset) dims flatten into one slot dim only if they are laid
    # out contiguously, which they are for any cache made by torch.empty/zeros.
    assert key_cache.stride(0) == key_cache.shape[1] * key_cache.stride(1)
    assert value_cache.stride(0) == value_cache.shape[1] * value_cache.stride(1)
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=next_power_of_2(num_kv_heads * head_dim),
    )


def _check() -> None:
    """Correctness check against the PyTorch reference, printing the largest error."""
    from minivllm.kernels import reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 8, 2, 32, 10
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[3] = -1  # a padding token
    slots = slots.to(torch.int64)
    caches = [torch.full(shape, -7.0, device=device) for _ in range(4)]
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reshape_and_cache(key, value, caches[2], caches[3], slots)
    err = max((caches[0] - caches[2]).abs().max().item(), (caches[1] - caches[3]).abs().max().item())
    print(f"reshape_and_cache: max abs error vs reference = {err:.3g}")


if __name__ == "__main__":
    _check()
