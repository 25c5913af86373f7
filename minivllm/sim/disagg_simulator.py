"""The disaggregated simulator: a prefill pool and a decode pool on one simulated time
(issue 33).

A laptop runs one prefill server and one decode server (``minivllm bench disagg``); the
question disaggregation answers, how many requests per second a cluster serves within a
time-to-first-token bound *and* a time-per-output-token bound, needs more instances and a
sweep of request rates. This module runs that split in simulated time, with the cluster
simulator's engines (the real scheduler and KV cache manager, a cost model for each step)
and its event loop:

* a request arrives at the prefill pool (the least busy instance), which computes its
  prompt and makes one token, as the router's prefill request does;
* its KV then travels to the decode pool: the full blocks' bytes over
  ``transfer_gb_per_s`` (NIXL over RDMA moves tens of GB/s; the shared folder here about
  1 to 2);
* a decode instance (the least busy) admits it with those blocks loaded, through a
  stand-in KV connector (:class:`SimulatedTransfer`) that tells the scheduler every full
  block of the prompt is loadable, computes the last partial block and generates.

The request's time to first token is counted from its arrival at the prefill pool to its
first token on the decode instance (prefill, transfer, the decode instance's queue), as a
client behind the router sees it. The colocated baseline is :func:`simulate_cluster` over
the same number of instances.

*Goodput* (DistServe's measure): the share of requests that meet both bounds, and the
highest request rate at which at least 90% do. Disaggregation helps when the TPOT bound
is tight (no decode step carries a prefill chunk); it costs when the TTFT bound is tight
(prompts queue for a prefill pool smaller than the whole cluster) or the transfer is slow.

In vLLM: the disaggregated-prefill benchmarks (``benchmarks/disagg_benchmarks/``) measure
the same on GPUs; DistServe (Zhong et al., OSDI 2024) chose each pool's size from goodput.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata
from minivllm.entrypoints.routing import LeastOutstanding
from minivllm.metrics import percentile
from minivllm.request import Request
from minivllm.sim.cluster_simulator import (
    MAX_TRACE_STEPS,
    Fleet,
    RequestSummary,
    make_replicas,
    simulate_cluster,
)
from minivllm.sim.cost_model import CostModel
from minivllm.sim.workload import WorkloadRequest


class SimulatedTransfer(KVConnectorBase_V1):
    """A decode instance's connector in the simulator: every full block of a prompt that
    the prefill pool computed is loadable (the transfer's time was spent before the request
    arrived here), so the scheduler allocates its slots and computes only the rest."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        loadable = (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size
        return max(0, loadable - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def update_connector_output(self, output) -> None:
        pass

    def request_finished(self, request: Request) -> None:
        pass


@dataclass
class DisaggResult:
    requests: list[RequestSummary]
    """Every request as its client saw it (arrival at the prefill pool, first token and
    finish on its decode engine, ``replica``: that engine), in the order they finished."""
    transferred_bytes: int
    """KV bytes that crossed from the prefill pool to the decode pool."""
    decode_prefill_tokens: int
    """Prompt tokens the decode pool computed (each prompt's last partial block)."""
    no_block_leaked: bool
    """Every block of every engine of both pools is free again."""


def simulate_disaggregated(workload: Iterable[WorkloadRequest], num_prefill: int, num_decode: int,
                           transfer_gb_per_s: float = 2.0, cost_model: CostModel | None = None,
                           **config: object) -> DisaggResult:
    """Serve ``workload`` (arrival times never decreasing) on ``num_prefill`` prefill and
    ``num_decode`` decode simulated engines; each request's KV crosses at
    ``transfer_gb_per_s``. ``config``: EngineConfig fields for every engine."""
    for name, n in (("num_prefill", num_prefill), ("num_decode", num_decode)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    if not transfer_gb_per_s > 0:
        raise ValueError(f"transfer_gb_per_s must be > 0, got {transfer_gb_per_s!r}")
    config.setdefault("max_trace_steps", MAX_TRACE_STEPS)
    prefill = Fleet(make_replicas(num_prefill, cost_model, config))
    cost_model = prefill.engines[0].model_runner.cost_model
    decode = Fleet(make_replicas(num_decode, cost_model, config))
    block_size = prefill.engines[0].config.block_size
    for engine in decode.engines:
        engine.scheduler.kv_connector = SimulatedTransfer(block_size)
    bytes_per_token = float(cost_model.meta.get("kv_bytes_per_token", 46080))
    route = LeastOutstanding()
    originals: dict[str, WorkloadRequest] = {}
    handoffs: list[tuple[float, int, str]] = []  # (arrival at the decode pool, order, id)
    served: list[RequestSummary] = []
    requests = iter(workload)
    pending = next(requests, None)
    handed, finished_prefill, finished_decode, moved, computed = 0, 0, 0, 0, 0
    while pending is not None or handoffs or prefill.ready or decode.ready:
        t, kind = _next_event(pending, handoffs, prefill, decode)
        if kind == "arrive":
            prefill.tell_finished_by(t)
            originals[pending.request_id] = pending
            prefill.add(route.choose([], prefill.states), dataclasses.replace(pending, max_tokens=1))
            pending = next(requests, None)
        elif kind == "handoff":
            _, _, rid = heapq.heappop(handoffs)
            decode.tell_finished_by(t)
            request = dataclasses.replace(originals[rid], arrival_time=t)
            decode.add(route.choose([], decode.states), request)
        elif kind == "prefill":
            prefill.step_next()
            for s in prefill.summaries[finished_prefill:]:
                full = (s.num_prompt_tokens - 1) // block_size * block_size
                seconds = full * bytes_per_token / (transfer_gb_per_s * 1e9)
                moved += int(full * bytes_per_token)
                heapq.heappush(handoffs, (s.finished_time + seconds, handed, s.request_id))
                handed += 1
            finished_prefill = len(prefill.summaries)
        else:
            engine = decode.engines[decode.ready[0][1]]
            decode.step_next()
            computed += engine.trace.steps[-1].num_prefill_tokens
            for s in decode.summaries[finished_decode:]:
                served.append(dataclasses.replace(s, arrival_time=originals.pop(s.request_id).arrival_time))
            finished_decode = len(decode.summaries)
    free = all(e.kv_cache_manager.block_pool.get_num_free_blocks() == e.kv_cache_manager.num_blocks
               for e in prefill.engines + decode.engines)
    return DisaggResult(served, moved, computed, free)


def _next_event(pending: WorkloadRequest | None, handoffs: list, prefill: Fleet, decode: Fleet) -> tuple[float, str]:
    """The earliest of: the next arrival, the next KV handoff, the next step of either pool
    (the replica furthest behind). On a tie, in that order: what arrives joins the step."""
    events = []
    if pending is not None:
        events.append((pending.arrival_time, 0, "arrive"))
    if handoffs:
        events.append((handoffs[0][0], 1, "handoff"))
    if prefill.ready:
        events.append((prefill.ready[0][0], 2, "prefill"))
    if decode.ready:
        events.append((decode.ready[0][0], 3, "decode"))
    t, _, kind = min(events)
    return t, kind


def attainment(served: list[RequestSummary], ttft_bound: float, tpot_bound: float) -> float:
    """The share of requests whose TTFT and TPOT are both within their bounds."""
    ok = sum(1 for s in served if s.ttft <= ttft_bound and s.tpot <= tpot_bound)
    return ok / len(served) if served else 0.0


def summary(served: list[RequestSummary]) -> dict[str, float]:
    ttft, tpot = [s.ttft for s in served], [s.tpot for s in served]
    return {"ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90),
            "tpot_p50": percentile(tpot, 50), "tpot_p90": percentile(tpot, 90)}


def goodput_sweep(make_workload, rates: list[float], num_prefill: int, num_decode: int,
                  ttft_bound: float, tpot_bound: float, transfer_gb_per_s: float = 2.0,
                  cost_model: CostModel | None = None, **config: object) -> list[dict]:
    """At each request rate, the same workload (``make_workload(rate)``) on the split and on
    ``num_prefill + num_decode`` colocated replicas (least outstanding): attainment of both
    bounds, and TTFT and TPOT percentiles, one row per (rate, layout)."""
    for name, bound in (("ttft_bound", ttft_bound), ("tpot_bound", tpot_bound)):
        if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
            raise ValueError(f"{name} must be a number of seconds > 0, got {bound!r}")
    rows = []
    for rate in rates:
        wall = time.perf_counter()
        split = simulate_disaggregated(make_workload(rate), num_prefill, num_decode, transfer_gb_per_s,
                                       cost_model, **config).requests
        together = simulate_cluster(make_workload(rate), num_prefill + num_decode, "least_outstanding",
                                    cost_model, **config).requests
        for layout, served in ((f"{num_prefill}P+{num_decode}D", split),
                               (f"{num_prefill + num_decode} colocated", together)):
            rows.append({"rate": rate, "layout": layout, "requests": len(served),
                         "attainment": attainment(served, ttft_bound, tpot_bound), **summary(served),
                         "wall_s": time.perf_counter() - wall})
    return rows
