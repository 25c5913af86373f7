"""Where offloaded KV blocks live: host memory and disk (vLLM: ``vllm/v1/kv_offload/``).

Used by :class:`~minivllm.distributed.kv_transfer.offloading_connector.OffloadingConnector`.
"""
