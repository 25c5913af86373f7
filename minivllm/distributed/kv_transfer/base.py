"""The KV connector: the one door through which KV blocks enter and leave an engine.

An engine's KV cache is private: blocks are computed by its model and read by its
attention. A *KV connector* lets blocks come from elsewhere and go elsewhere: to host
memory and disk when the cache is full (``OffloadingConnector``), or, in vLLM, to another
engine that decodes what this one prefilled (disaggregated prefill, over NIXL, Mooncake or
LMCache). The engine does not care where: it asks the connector, at two places, through
the interface below, which is vLLM V1's (``vllm/distributed/kv_transfer/kv_connector/v1/
base.py``, ``KVConnectorBase_V1``) with its method names.

**Scheduler side**, between steps, where blocks are allocated:

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: a waiting request has
   found ``num_computed_tokens`` tokens in the local prefix cache; how many *more* of its
   tokens can the connector supply, and will it load them in the background? The
   scheduler skips computing them.
2. ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the blocks they
   will be loaded into are now allocated.
3. ``build_connector_meta(scheduler_output)``: everything to move this step (loads, saves),
   packed into one metadata object that travels to the worker with the batch.
4. ``update_connector_output(output)``: the worker's report, after the step.
5. ``request_finished(request)``: forget a request.

**Worker side**, inside the forward pass, where the tensors are:

1. ``register_kv_caches(kv_caches)``: once, the cache tensors of every layer;
2. ``bind_connector_metadata(meta)``, then ``start_load_kv()`` before the forward pass;
3. in every attention layer, ``wait_for_layer_load(layer)`` before it reads the cache and
   ``save_kv_layer(layer, kv_layer, attn_metadata)`` after it wrote its new keys and values;
4. ``wait_for_save()`` after the forward pass, then ``get_finished()`` and
   ``clear_connector_metadata()``.

Per layer, because on a GPU transfers run on their own stream: layer 3 can compute while
layer 4's blocks are still arriving and layer 2's are leaving. On a CPU there is no second
stream, and minivllm's connectors copy from RAM synchronously; the calls are where they
would be.

**A load in the background.** A load that takes long (from disk, or from another machine)
should not hold up the step: everyone else's next token would wait for it. So
``get_num_new_matched_tokens`` may answer that its load is asynchronous. The scheduler
then allocates the request's blocks, keeps them out of the prefix cache, and parks the
request in ``WAITING_FOR_REMOTE_KVS``, in no step; the worker side starts the load in
``start_load_kv`` and lets it run while the steps go on, and ``get_finished`` names the
requests whose blocks have arrived (``finished_recving``). The step after that, the request
is admitted with those tokens computed. A step with nothing to compute still runs the
connector (the model runner's ``kv_connector_no_forward``), so that loads are started and
their arrival is noticed.

In vLLM the two sides are two objects in two processes (the scheduler's and each GPU
worker's, ``KVConnectorRole``). In minivllm the scheduler and the model runner share the
engine core's process, so one object serves both sides; what crosses between them still
goes through ``SchedulerOutput.kv_connector_metadata`` and ``ModelRunnerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minivllm.metrics import Metric

if TYPE_CHECKING:
    from minivllm.core.scheduler import SchedulerOutput
    from minivllm.request import Request
    from minivllm.worker.attention import AttentionMetadata


class KVConnectorMetadata:
    """What the scheduler side tells the worker side about one step; each connector
    subclasses it with its own fields."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step (vLLM's ``KVConnectorOutput``, which also
    names the requests whose asynchronous sends finished: minivllm's sends are synchronous)."""

    finished_recving: set[str] = field(default_factory=set)
    """Requests whose background load finished since the last report (their failed
    blocks, if any, are in ``invalid_block_ids``)."""
    invalid_block_ids: set[int] = field(default_factory=set)
    """Engine blocks whose load failed: they hold garbage, and the requests holding them
    compute again from there (``minivllm.core.sched_utils.recompute_failed_loads``)."""


class KVConnectorBase_V1:  # noqa: N801  (vLLM's name)
    """The interface, with do-nothing defaults: a connector overrides what it uses."""

    _metadata: KVConnectorMetadata | None = None

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past ``num_computed_tokens`` that the connector can load into the cache,
        whether it loads them in the background). The tokens are a whole number of blocks,
        never the request's last token (it must run to give logits). A background load
        parks the request in ``WAITING_FOR_REMOTE_KVS`` until ``get_finished`` reports it."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """``block_ids``: the request's whole block table, now allocated; the external
        tokens go into the blocks right after its local prefix-cache hits."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The step ran; what the worker side reported."""

    def request_finished(self, request: Request) -> None:
        """The request finished or was aborted; its blocks are about to be freed (so a
        background load into them must be over when this returns)."""

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Before the forward pass: start loading this step's blocks into the cache."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """In layer ``layer_idx``'s attention, before it reads the cache."""

    def save_kv_layer(self, layer_idx: int, kv_layer: tuple[torch.Tensor, torch.Tensor],
                      attn_metadata: AttentionMetadata) -> None:
        """In layer ``layer_idx``'s attention, after its new keys and values are written."""

    def wait_for_save(self) -> None:
        """After the forward pass: every save of this step has been issued."""

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    # -- both -------------------------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        """The connector's counters, for ``/metrics`` (``minivllm:`` names)."""
        return []

    def shutdown(self) -> None:
        """The engine is stopping: keep what should outlive it."""

