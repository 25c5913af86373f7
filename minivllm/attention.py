"""The seam where a serving engine takes over from the model (notebooks 01 and 05).

transformers lets a program register its own attention function under a name
(``AttentionInterface``). minivllm registers ``"minivllm"``: every attention layer of a
stock Llama / Qwen2 / Mistral then calls :func:`paged_attention_forward` with its
freshly projected (and rotated) queries, keys and values. That function writes the new
keys and values into the paged KV cache and attends over the cache through the block
tables. The model code stays untouched; the engine owns memory.

The per-step metadata travels as an explicit keyword argument of the forward call
(``attn_metadata=...``), which transformers passes down to every attention layer. No
global context.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from minivllm.kernels import reference
from minivllm.kernels.triton_utils import interpreting, triton_available

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "minivllm"
BACKENDS = ("auto", "torch", "triton")


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they may attend to (vLLM's names)."""

    slot_mapping: torch.Tensor
    """[num_tokens] flat cache slot of each new token: block_id * block_size + offset."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] physical block ids of each scheduled sequence."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] where each sequence's tokens start in the flat batch (cu_seqlens_q)."""
    seq_lens: torch.Tensor
    """[num_seqs] tokens in the cache for each sequence after this step."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    reshape_and_cache: Callable
    paged_attention: Callable
    plan: reference.AttentionPlan | None = None
    """What the PyTorch path works out once per step for all layers (None for Triton)."""


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls in every layer.

    Shapes from transformers: query ``[1, num_heads, num_tokens, head_dim]`` and key,
    value ``[1, num_kv_heads, num_tokens, head_dim]``: the whole flat batch is one
    "sequence" of ``num_tokens``. Returns ``[1, num_tokens, num_heads, head_dim]``.
    """
    if attn_metadata is None:
        raise RuntimeError(
            "the minivllm attention implementation needs attn_metadata; "
            "call the model through minivllm's ModelRunner"
        )
    md = attn_metadata
    key_cache, value_cache = md.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    md.reshape_and_cache(key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache, md.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    extra = {} if md.plan is None else {"plan": md.plan}
    out = md.paged_attention(
        q.contiguous(), key_cache, value_cache, md.block_tables, md.query_start_loc, md.seq_lens, scale, **extra
    )
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """The paged kernels apply causality themselves from positions; no mask tensor."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" picks Triton on CUDA and PyTorch elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError(
            'attention_backend="triton" needs the triton package, which publishes wheels for '
            'Linux only. Install it with `pip install triton` on Linux, or use '
            'attention_backend="torch" (the PyTorch reference path, same results).'
        )
    return backend


def get_attention_ops(backend: str, device: torch.device) -> tuple[Callable, Callable]:
    """(reshape_and_cache, paged_attention) for a resolved backend."""
    if backend == "torch":
        return reference.reshape_and_cache, reference.paged_attention
    if device.type != "cuda" and not interpreting():
        # Triton's interpreter must be chosen before triton is first imported, and
        # `import minivllm` already imports it (through transformers and torch), so
        # it is too late to switch here.
        raise RuntimeError(
            'attention_backend="triton" on a CPU runs Triton\'s interpreter, which must be '
            "switched on before anything imports triton: set the environment variable "
            "TRITON_INTERPRET=1 before `import minivllm` (first notebook cell: "
            "`import os; os.environ['TRITON_INTERPRET'] = '1'`), or use "
            'attention_backend="torch" (same results).'
        )
    if device.type != "cuda":
        logger.warning("No GPU: the Triton kernels run in Triton's interpreter (slow, for learning).")
    from minivllm.kernels.paged_attention_v2 import paged_attention
    from minivllm.kernels.triton_reshape_and_cache import reshape_and_cache

    return reshape_and_cache, paged_attention
