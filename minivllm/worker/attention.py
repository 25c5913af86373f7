"""The seam where a serving engine takes over from the model (notebooks 01 and 05).

transformers lets a program register its own attention function under a name
(``AttentionInterface``). minivllm registers ``"minivllm"``: every attention layer of a
stock Llama / Qwen2 / Mistral then calls :func:`paged_attention_forward` with its
freshly projected (and rotated) queries, keys and values, and that function makes one
call: :meth:`AttentionBackend.forward`, which writes the new keys and values into the
paged KV cache and attends over the cache through the block tables. The model code stays
untouched; the engine owns memory.

An attention backend is an object with the few operations the model runner needs:

- :meth:`~AttentionBackend.build_metadata`, once per step: from the step's common
  metadata (:class:`AttentionMetadata`) to what this backend's kernels read;
- :meth:`~AttentionBackend.forward`, once per layer: ``write_kv`` then ``attend``.

:class:`TorchAttentionBackend` runs the PyTorch reference (``minivllm/kernels/reference.py``,
the CPU serving path); :class:`TritonAttentionBackend` runs the Triton kernels. vLLM
spreads each backend over three classes (``AttentionBackend`` names the parts,
``AttentionMetadataBuilder.build`` makes the per-step metadata, ``AttentionImpl.forward``
writes K/V and attends; vllm/v1/attention/backends/); one object does here.

The backend and the step's metadata travel as explicit keyword arguments of the forward
call (``attn_backend=..., attn_metadata=...``), which transformers passes down to every
attention layer. No global context.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from minivllm.compilation import unified_attention
from minivllm.config import BACKENDS
from minivllm.kernels import reference
from minivllm.kernels.triton_utils import interpreting, triton_available
from minivllm.worker.kv_cache_quant import quantize_kv

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "minivllm"
BACKEND_CLASSES = {"torch": "minivllm.worker.attention:TorchAttentionBackend",
                   "triton": "minivllm.worker.attention:TritonAttentionBackend"}
"""The class each backend name stands for (``attention_backend`` also takes a class of
your own: the build-it-yourself hook, ``minivllm.config.COMPONENT_FIELDS``)."""

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they may attend to, the same for every
    backend and every layer (vLLM's ``CommonAttentionMetadata``)."""

    slot_mapping: torch.Tensor
    """[num_tokens] flat cache slot of each new token: block_id * block_size + offset."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] physical block ids of each scheduled sequence."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] where each sequence's tokens start in the flat batch (cu_seqlens_q)."""
    seq_lens: torch.Tensor
    """[num_seqs] tokens in the cache for each sequence after this step."""


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    plan: reference.AttentionPlan
    """The batch sorted into prefills and length-grouped decodes, worked out once per
    step for all layers."""


class AttentionBackend(ABC):
    """Paged attention over one engine's KV cache: per step, build the metadata; per
    layer, store the new keys and values and attend."""

    name: str

    def __init__(self, kv_caches: list[KVCache], device: torch.device,
                 kv_scales: list[tuple[float, float]] | None = None) -> None:
        self.kv_caches = kv_caches
        """Per layer (key_cache, value_cache), allocated by the model runner."""
        self.kv_scales = kv_scales
        """Per layer (k_scale, v_scale) of an 8-bit cache (``minivllm.worker.kv_cache_quant``);
        None: the cache holds the keys and values as they are."""

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """Once per step: what this backend's kernels need beyond the common metadata."""
        return common

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Once per layer. ``query`` ``[num_tokens, num_heads, head_dim]``, ``key`` and
        ``value`` ``[num_tokens, num_kv_heads, head_dim]``; returns the attention output
        shaped like ``query``. The keys are stored first, so every query sees the keys of
        its own sequence's new tokens (causality is the kernels' job).

        With an 8-bit cache the keys and values are stored divided by their layer's
        scales, and the scales come back in two multiplications: ``k_scale`` into the
        softmax scale (``q . (k_scale k8) = k_scale (q . k8)``) and ``v_scale`` onto the
        output (the softmax weights sum to one over ``v_scale v8``). ``attend`` only
        converts the 8-bit tiles it loads to the query's dtype."""
        key_cache, value_cache = self.kv_caches[layer_idx]
        if self.kv_scales is None:
            self.write_kv(key, value, key_cache, value_cache, metadata)
            return self.attend(query, key_cache, value_cache, metadata, scale)
        k_scale, v_scale = self.kv_scales[layer_idx]
        self.write_kv(quantize_kv(key, k_scale, key_cache.dtype),
                      quantize_kv(value, v_scale, value_cache.dtype), key_cache, value_cache, metadata)
        return self.attend(query, key_cache, value_cache, metadata, scale * k_scale).mul_(v_scale)

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Store the new keys and values at ``metadata.slot_mapping`` (vLLM: reshape_and_cache)."""

    @abstractmethod
    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of the flat batch of queries over the paged cache: query ``i``
        of sequence ``s`` sits at position ``seq_lens[s] - q_len + i`` and attends to that
        sequence's keys at positions up to its own, found through ``block_tables[s]``."""


class TorchAttentionBackend(AttentionBackend):
    """The PyTorch reference: SDPA over gathered K/V, the engine's CPU path."""

    name = "torch"

    def __init__(self, kv_caches: list[KVCache], device: torch.device,
                 kv_scales: list[tuple[float, float]] | None = None) -> None:
        super().__init__(kv_caches, device, kv_scales)
        self.workspace: torch.Tensor | None = None
        """Where decodes gather K and V (in the query's dtype), kept from step to step and
        grown, never shrunk, to the largest group seen (AttentionPlan.workspace says why)."""

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        block_size = self.kv_caches[0][0].shape[1]
        plan = reference.plan_attention(common.block_tables, common.query_start_loc, common.seq_lens, block_size)
        return TorchAttentionMetadata(common.slot_mapping, common.block_tables, common.query_start_loc,
                                      common.seq_lens, plan)

    def write_kv(self, key, value, key_cache, value_cache, metadata) -> None:
        reference.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)

    def attend(self, query, key_cache, value_cache, metadata: TorchAttentionMetadata, scale) -> torch.Tensor:
        need = metadata.plan.workspace_size(key_cache.shape[2] * key_cache.shape[3])
        if self.workspace is None or self.workspace.numel() < need or self.workspace.dtype != query.dtype:
            self.workspace = query.new_empty(need)
        metadata.plan.workspace = self.workspace
        return reference.paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                         metadata.query_start_loc, metadata.seq_lens, scale, plan=metadata.plan)


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels: ``triton_reshape_and_cache`` and the unified ``paged_attention_v2``.
    Their grid comes from the common metadata, so there is nothing more to build per step."""

    name = "triton"

    def __init__(self, kv_caches: list[KVCache], device: torch.device,
                 kv_scales: list[tuple[float, float]] | None = None) -> None:
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
        super().__init__(kv_caches, device, kv_scales)
        # Imported here, not at the top: triton exists on Linux only, and `import
        # minivllm` must work everywhere.
        from minivllm.kernels.paged_attention_v2 import paged_attention
        from minivllm.kernels.triton_reshape_and_cache import reshape_and_cache

        self._reshape_and_cache = reshape_and_cache
        self._paged_attention = paged_attention

    def write_kv(self, key, value, key_cache, value_cache, metadata) -> None:
        self._reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)

    def attend(self, query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
        return self._paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                     metadata.query_start_loc, metadata.seq_lens, scale)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_backend: AttentionBackend | None = None,
    attn_metadata: AttentionMetadata | None = None,
    kv_connector=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls in every layer.

    Shapes from transformers: query ``[1, num_heads, num_tokens, head_dim]`` and key,
    value ``[1, num_kv_heads, num_tokens, head_dim]``: the whole flat batch is one
    "sequence" of ``num_tokens``. Returns ``[1, num_tokens, num_heads, head_dim]``.
    With a KV connector (``minivllm.distributed.kv_transfer``) the layer waits for its
    loaded blocks first and hands its cache to the connector to save after. Called with
    none of the three (the compiled model), it goes through the opaque op
    :func:`minivllm.compilation.unified_attention`.
    """
    q = query[0].transpose(0, 1).contiguous()  # [num_tokens, num_heads, head_dim]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    layer = module.layer_idx
    if attn_backend is None and attn_metadata is None and kv_connector is None:
        # The compiled model (minivllm.compilation): one opaque op, which finds the backend
        # and the step's metadata in the forward context the runner set around the call.
        out = unified_attention(q, key[0].transpose(0, 1), value[0].transpose(0, 1), layer, scale)
        return out.unsqueeze(0), None
    if attn_backend is None or attn_metadata is None:
        raise RuntimeError(
            "the minivllm attention implementation needs attn_backend and attn_metadata; "
            "call the model through minivllm's ModelRunner"
        )
    if kv_connector is not None:
        kv_connector.wait_for_layer_load(layer)
    out = attn_backend.forward(layer, q, key[0].transpose(0, 1), value[0].transpose(0, 1),
                               attn_metadata, scale)
    if kv_connector is not None:
        kv_connector.save_kv_layer(layer, attn_backend.kv_caches[layer], attn_metadata)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """The paged kernels apply causality themselves from positions; no mask tensor."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def resolve_backend(backend: str, device: torch.device) -> str:
    """A backend's name: "auto" picks Triton on CUDA and PyTorch elsewhere."""
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


def get_attn_backend(backend: str | type[AttentionBackend], kv_caches: list[KVCache],
                     device: torch.device, kv_scales: list[tuple[float, float]] | None = None
                     ) -> AttentionBackend:
    """The backend object over these caches: of a resolved name (:func:`resolve_backend`),
    or of an :class:`AttentionBackend` class. ``kv_scales`` is passed only for an 8-bit
    cache, so a learner's backend written before it existed still takes two arguments."""
    if isinstance(backend, str):
        backend = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}[backend]
    if kv_scales is None:
        return backend(kv_caches, device)
    return backend(kv_caches, device, kv_scales=kv_scales)
