"""SharedStorageConnector: prefill in one engine, decode in another, KV through a folder.

Disaggregated prefill splits a request's two phases across engines: a *prefill* engine
(``kv_role="kv_producer"``) computes the prompt and writes its KV, a *decode* engine
(``kv_role="kv_consumer"``) loads that KV and generates. Each engine then runs one kind of
step, so a long prompt never sits in a step beside someone's decode: the decode engine's
inter-token latency no longer depends on what prompts arrive (what DistServe measures as
goodput). It costs a transfer per request and a second engine's memory, and it does not
raise throughput (vLLM's documentation says so plainly).

Here the KV goes through a shared folder: the producer writes every full block it
computes to the folder in the step that computes it (one safetensors file per block,
named by its prefix-cache hash, as the offloading connector's disk tier does), and the
consumer looks each block of a new prompt up there by hash and loads it, computing only
the partial block at the end. The consumer reads the files in the background, on a thread
of its own, while its steps go on: the request waits aside (``WAITING_FOR_REMOTE_KVS``)
and the decodes already running never wait for a file (vLLM's ``NixlConnector`` loads
asynchronously the same way). Nothing else changes: the hash chain makes "this block is
the KV of exactly this prefix" checkable by name. ``kv_role="kv_both"`` does both.

In vLLM: ``ExampleConnector`` in ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``
(``SharedStorageConnector`` until vllm#30201 renamed it, December 2025; this engine takes
either name), an example for connector writers (one folder per request) that its
disaggregated-prefill examples use, not for production. Production deployments move KV
GPU to GPU (``NixlConnector`` over RDMA or NVLink, ``MooncakeConnector``, LMCache), and a
proxy sends each request to a prefill engine with ``max_tokens=1`` first, then to a
decode engine. On several machines this folder would have to be a network file system;
on one, it is a page-cache copy.
"""

from __future__ import annotations

from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.offloading_connector import OffloadingConnector
from minivllm.exceptions import ValidationError, check_int, check_keys, check_path

EXTRA_CONFIG = {"shared_storage_path": "the folder both engines use (required)",
                "num_cpu_blocks": "blocks staged in RAM between the forward pass and the folder (default 256)",
                "num_disk_blocks": "blocks the folder keeps, least recently used dropped (default 4096: about 3 GB for "
                                   "SmolLM2-135M in float32, as the offloading connector's disk tier)"}


class SharedStorageConnector(OffloadingConnector):
    @staticmethod
    def parse_extra_config(config: KVTransferConfig) -> tuple[int, str | None, int]:
        extra = config.kv_connector_extra_config
        check_keys("kv_connector_extra_config", extra, EXTRA_CONFIG, "SharedStorageConnector")
        if "shared_storage_path" not in extra:
            raise ValidationError("shared_storage_path", "SharedStorageConnector needs "
                                  'kv_connector_extra_config["shared_storage_path"]: the folder '
                                  "the producer writes and the consumer reads", extra)
        num_cpu = check_int("num_cpu_blocks", extra.get("num_cpu_blocks", 256), minimum=1)
        num_disk = check_int("num_disk_blocks", extra.get("num_disk_blocks", 4096), minimum=1)
        return num_cpu, check_path("shared_storage_path", extra["shared_storage_path"]), num_disk
