"""KV transfer: KV blocks that enter and leave an engine through a connector.

- :mod:`~minivllm.distributed.kv_transfer.base`: the connector interface (vLLM V1's
  ``KVConnectorBase_V1``), its scheduler side and its worker side;
- :mod:`~minivllm.distributed.kv_transfer.offloading_connector`: blocks that spill to RAM
  and disk and come back as prefix-cache hits;
- :mod:`~minivllm.distributed.kv_transfer.shared_storage_connector`: disaggregated prefill,
  a prefill engine's blocks loaded by a decode engine through a shared folder.

The engine makes its connector with :func:`make_kv_connector` from
``EngineConfig.kv_transfer_config`` (vLLM's ``--kv-transfer-config``).

In vLLM: ``vllm/distributed/kv_transfer/`` (``kv_connector/factory.py`` names the nine
connectors).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from minivllm.config import EngineConfig, KVTransferConfig
from minivllm.exceptions import ValidationError

if TYPE_CHECKING:
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1
    from minivllm.worker.kv_cache_quant import KVCacheQuantization


def make_kv_connector(config: EngineConfig, kv_cache_manager: KVCacheManager,
                      model: PreTrainedModel, cache_shape: tuple[int, int, int], cache_dtype: torch.dtype,
                      kv_cache_quantization: KVCacheQuantization | None,
                      simulated: bool = False) -> KVConnectorBase_V1:
    """The connector ``config.kv_transfer_config`` names, over this engine's KV cache:
    ``cache_shape`` is its (layers, KV heads, head dim), ``cache_dtype`` its dtype.

    Its worker side lives in the model runner, so the engine must build that runner in
    its own process: a simulated runner or tensor-parallel workers are refused by name.
    The blocks it keeps are only meaningful to the model and cache layout that computed
    them, so it is told that layout (written down with the disk tier's files), with a
    fingerprint of the weights (the first values of every parameter): two models of one
    architecture never read each other's blocks."""
    from minivllm.distributed.kv_transfer.offloading_connector import OffloadingConnector
    from minivllm.distributed.kv_transfer.shared_storage_connector import SharedStorageConnector

    if config.tensor_parallel_size > 1 or simulated:
        raise ValidationError("kv_transfer_config", "a KV connector needs the model runner in the "
                              "engine's process: it cannot be combined with tensor_parallel_size > 1 "
                              "or a simulated runner", config.kv_transfer_config)
    num_layers, num_kv_heads, head_dim = cache_shape
    block_shape = (num_layers, 2, config.block_size, num_kv_heads, head_dim)
    scales = kv_cache_quantization.scales if kv_cache_quantization else None
    weights = hashlib.sha256()
    for p in model.parameters():
        weights.update(p.detach().flatten()[:64].float().cpu().numpy().tobytes())
    layout = (f"model={config.model} dtype={config.dtype} kv_cache_dtype={cache_dtype} "
              f"kv_scales={scales} quantization={config.quantization} block_size={config.block_size} "
              f"weights={weights.hexdigest()[:16]}\n{model.config.to_json_string()}")
    transfer = KVTransferConfig.parse(config.kv_transfer_config)
    cls = {"OffloadingConnector": OffloadingConnector, "ExampleConnector": SharedStorageConnector,
           "SharedStorageConnector": SharedStorageConnector}[transfer.kv_connector]
    return cls(transfer, kv_cache_manager, block_shape, cache_dtype, layout)
