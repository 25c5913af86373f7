"""How many KV blocks the engine gets, and the longest request they must hold.

The engine and the simulator both size their cache with :func:`size_kv_cache`, so a
simulated run has exactly the blocks the real one would.

In vLLM: ``vllm/v1/core/kv_cache_utils.py`` (``get_kv_cache_configs``, and the check
that ``max_model_len`` fits the memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from minivllm.core.kv_cache_manager import cdiv
from minivllm.exceptions import ValidationError


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int
    """The longest request (prompt plus output) the engine accepts."""

    @property
    def num_tokens(self) -> int:
        """Tokens the whole cache holds."""
        return self.num_blocks * self.block_size


def size_kv_cache(config: EngineConfig, bytes_per_token: int, model_max_len: int) -> KVCacheSize:
    """How many KV blocks, and the longest request they must hold.

    ``bytes_per_token`` is what one token costs in the cache (K and V, every layer;
    ``model_runner.kv_cache_bytes_per_token``), ``model_max_len`` the model's
    ``max_position_embeddings``. Without ``num_kv_blocks`` the cache gets
    ``kv_cache_memory`` bytes, or by default 1 GiB but no more than ``max_num_seqs``
    requests of full length can use. ``max_model_len`` defaults to what both the model
    and the cache allow; one that the cache cannot hold is refused, as vLLM refuses it:
    a request may grow that long (a chat request without max_tokens does), and one that
    never fits could never run.
    """
    block_bytes = bytes_per_token * config.block_size
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = (config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // block_bytes
        if config.kv_cache_memory is None:  # don't reserve more than the engine can use
            max_len = config.max_model_len or model_max_len
            num_blocks = min(num_blocks, config.max_num_seqs * cdiv(max_len, config.block_size))
    if num_blocks < 1:
        raise ValidationError(
            "kv_cache_memory",
            f"the KV cache holds no block: one block of {config.block_size} tokens needs "
            f"{block_bytes} bytes, kv_cache_memory is {config.kv_cache_memory}",
            config.kv_cache_memory)
    capacity = num_blocks * config.block_size
    max_model_len = config.max_model_len or min(model_max_len, capacity)
    if max_model_len > model_max_len:
        raise ValidationError(
            "max_model_len", f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_max_len}", max_model_len)
    if max_model_len > capacity:
        raise ValidationError(
            "max_model_len",
            f"max_model_len {max_model_len} is more than the KV cache holds: "
            f"{num_blocks} blocks of {config.block_size} tokens = {capacity} tokens. "
            f"Give the cache more blocks (num_kv_blocks, kv_cache_memory) or lower max_model_len",
            max_model_len)
    return KVCacheSize(num_blocks, config.block_size, block_bytes, max_model_len)
