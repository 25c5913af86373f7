"""The cluster simulator: N simulated replicas behind one router, on one simulated time.

A laptop runs one engine, perhaps two. The question routing answers (does it matter which
replica serves a request?) only gets interesting at 8, 32, 64 replicas and thousands of
requests, where each replica's prefix cache holds a small slice of the traffic and a blind
router scatters related requests over all of them. This module runs that cluster in
simulated time: N engines from :func:`~minivllm.sim.simulator.make_simulated_engine` (each the
real scheduler and KV cache manager, prefix caching on, with its own virtual clock) and
one routing policy from :mod:`minivllm.entrypoints.routing`, the same objects the HTTP router uses
(notebook 14).

Why a discrete-event loop, and how it keeps causality. Each replica has its own clock,
and a step is atomic: it starts at its replica's clock and ends a cost-model duration
later. The loop always handles the *earliest* thing that can happen next: the next
arrival, or the step of the busy replica whose clock is furthest behind (ties: the
arrival first, as :func:`~minivllm.sim.replay.replay_workload` adds arrivals before it
steps). Three rules follow from that order:

- When an arrival at time ``t`` is routed, every busy replica's clock is at ``t`` or
  later (an earlier step would have been handled first), so the request joins the
  replica's next step, never one that started before it arrived. An idle replica whose
  clock lags behind jumps forward to ``t`` (it was waiting for work), as a single
  engine's replay advances its clock to the next arrival.
- A request that finishes in a step finishes at that step's *end*. The loop handles a
  step when it starts, so it does not tell the router at once: the finish is kept in a
  heap by its end time and the replica's outstanding count drops only when an arrival at
  or after that time is routed. The router sees exactly the counts of time ``t``.
- Arrivals must come in time order (the workload's ``arrival_time`` never decreases).

With one replica the loop does exactly what ``replay_workload`` does, so every policy
gives the single-engine simulator's numbers (the tests check it, request by request).

What a run keeps: a small summary per request (its own :class:`~minivllm.metrics.RequestMetrics`
timestamps, replica and prompt-cache hits) and per replica (requests, prefix-cache
queries and hits, busy time, free blocks at the end); the engines' traces keep only
their last few steps, so memory stays bounded for thousands of requests. The sweep
over replica counts and policies is ``minivllm bench simulate-cluster``.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.entrypoints.routing import PrefixAware, ReplicaState, RoutingPolicy, make_policy
from minivllm.metrics import percentile
from minivllm.sim.cost_model import CostModel
from minivllm.sim.simulator import make_simulated_engine
from minivllm.sim.workload import WorkloadRequest

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine

MAX_TRACE_STEPS = 200
"""Steps each replica's trace keeps (as :func:`~minivllm.sim.simulator.simulate` does)."""


@dataclass
class RequestSummary:
    """One finished request: its engine's timestamps (simulated seconds) and where it ran."""

    request_id: str
    replica: int
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens its replica's prefix cache already held when it was admitted."""
    num_output_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for a one-token answer)."""
        n = self.num_output_tokens - 1
        return (self.finished_time - self.first_token_time) / n if n > 0 else 0.0


@dataclass
class ReplicaSummary:
    """One replica at the end of a run."""

    num_requests: int
    prefix_queries: int
    """Prompt tokens looked up in its prefix cache (first admissions only, as vLLM counts)."""
    prefix_hits: int
    busy_seconds: float
    """Sum of its steps' durations: how long it computed."""
    num_steps: int
    num_preemptions: int
    free_blocks_after: int
    num_blocks: int


@dataclass
class ClusterResult:
    """What one simulated run of a cluster measured."""

    policy: str
    num_replicas: int
    requests: list[RequestSummary]
    """In the order they finished."""
    replicas: list[ReplicaSummary]
    num_requests: int
    """Requests routed (all of the workload)."""
    simulated_seconds: float
    """From time 0 to the last finish, on the cluster's one simulated time line."""
    wall_seconds: float
    num_fallbacks: int | None = None
    """Prefix-aware only: requests sent to a less busy replica than the one holding their
    prefix, because that one was saturated."""
    routing_log: list[tuple[str, float, tuple[int, ...]]] | None = None
    """With ``record_routing``: (request id, arrival time, outstanding count per replica
    the router saw) for each request, in routing order."""

    @property
    def num_finished(self) -> int:
        return len(self.requests)

    @property
    def ttft(self) -> list[float]:
        return [r.ttft for r in self.requests]

    @property
    def e2e(self) -> list[float]:
        return [r.e2e for r in self.requests]

    @property
    def hit_rate(self) -> float:
        """The cluster's prefix-cache hit rate: all replicas' hits over all their queries."""
        queries = sum(r.prefix_queries for r in self.replicas)
        return sum(r.prefix_hits for r in self.replicas) / queries if queries else 0.0

    @property
    def requests_per_replica(self) -> list[int]:
        return [r.num_requests for r in self.replicas]

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second, the whole cluster."""
        return self.output_tokens / self.simulated_seconds if self.simulated_seconds else 0.0

    @property
    def no_block_leaked(self) -> bool:
        """Every block of every replica is free again (cached prefixes stay evictable)."""
        return all(r.free_blocks_after == r.num_blocks for r in self.replicas)

    def row(self) -> SweepRow:
        """The plain numbers a table or figure needs."""
        ttft = self.ttft
        counts = self.requests_per_replica
        return SweepRow(
            policy=self.policy, num_replicas=self.num_replicas, num_requests=self.num_requests,
            hit_rate=self.hit_rate, mean_ttft=sum(ttft) / len(ttft) if ttft else 0.0,
            p50_ttft=percentile(ttft, 50) if ttft else 0.0, p99_ttft=percentile(ttft, 99) if ttft else 0.0,
            throughput=self.throughput, min_requests=min(counts), max_requests=max(counts),
            wall_seconds=self.wall_seconds,
        )


@dataclass
class SweepRow:
    """One (policy, replica count) point of a sweep, as plain numbers."""

    policy: str
    num_replicas: int
    num_requests: int
    hit_rate: float
    mean_ttft: float
    p50_ttft: float
    p99_ttft: float
    throughput: float
    """Output tokens per simulated second."""
    min_requests: int
    max_requests: int
    """Fewest and most requests any replica served: the balance."""
    wall_seconds: float


def _policy_for(policy: str | RoutingPolicy, block_size: int) -> RoutingPolicy:
    if isinstance(policy, str):
        return make_policy(policy, block_size=block_size)
    if isinstance(policy, PrefixAware) and policy.block_size != block_size:
        raise ValueError(f"the prefix-aware policy hashes blocks of {policy.block_size} tokens but the "
                         f"replicas' blocks hold {block_size}: its picture of their caches would never "
                         f"match; make it with block_size={block_size}")
    return policy


def simulate_cluster(
    workload: Iterable[WorkloadRequest],
    num_replicas: int,
    policy: str | RoutingPolicy = "prefix_aware",
    cost_model: CostModel | None = None,
    record_routing: bool = False,
    **config: object,
) -> ClusterResult:
    """Serve ``workload`` (arrival times in simulated seconds, never decreasing) on
    ``num_replicas`` simulated engines behind ``policy`` (a name of
    :data:`~minivllm.entrypoints.routing.ROUTING_POLICIES` or a policy object, used as it is).

    ``config``: :class:`~minivllm.config.EngineConfig` fields for every replica (prefix
    caching stays on unless it says otherwise). ``cost_model`` None: this machine's
    calibration, else the shipped one (warned). The event loop is the module docstring's:
    the earliest of the next arrival and the next step goes first, the arrival on a tie.
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    config.setdefault("max_trace_steps", MAX_TRACE_STEPS)
    fleet = Fleet(make_replicas(num_replicas, cost_model, config))
    router = _policy_for(policy, fleet.engines[0].config.block_size)
    log: list[tuple[str, float, tuple[int, ...]]] | None = [] if record_routing else None
    requests = iter(workload)
    pending = next(requests, None)
    last_arrival = 0.0
    wall = time.perf_counter()
    while pending is not None or fleet.ready:
        if pending is not None and (not fleet.ready or pending.arrival_time <= fleet.ready[0][0]):
            t = pending.arrival_time
            if t < last_arrival:
                raise ValueError(f"request {pending.request_id!r} arrives at {t} s, before the one "
                                 f"routed earlier ({last_arrival} s): sort the workload by arrival time")
            last_arrival = t
            fleet.tell_finished_by(t)
            if log is not None:
                log.append((pending.request_id, t, tuple(s.outstanding for s in fleet.states)))
            fleet.add(router.choose(pending.prompt_token_ids, fleet.states), pending)
            pending = next(requests, None)
        else:
            fleet.step_next()
    summaries = fleet.summaries
    return ClusterResult(
        policy=router.name, num_replicas=num_replicas, requests=summaries,
        replicas=fleet.replica_summaries(), num_requests=sum(fleet.counts),
        simulated_seconds=max((r.finished_time for r in summaries), default=0.0),
        wall_seconds=time.perf_counter() - wall,
        num_fallbacks=router.fallbacks if isinstance(router, PrefixAware) else None,
        routing_log=log,
    )


def make_replicas(num_replicas: int, cost_model: CostModel | None, config: dict) -> list[LLMEngine]:
    """``num_replicas`` alike simulated engines sharing one cost model, resolved once (this
    machine's, or the shipped one) so that the warning about it, if any, is said once."""
    first = make_simulated_engine(cost_model, **config)
    cost_model = first.model_runner.cost_model
    engines = [first]
    logger = logging.getLogger("minivllm")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))  # the replicas are alike: the first one's
    try:                                          # KV cache line says it for all of them
        engines += [make_simulated_engine(cost_model, **config) for _ in range(num_replicas - 1)]
    finally:
        logger.setLevel(level)
    return engines


class Fleet:
    """The replicas of :func:`simulate_cluster` and its event loop's state.

    Invariants: ``ready`` is a heap of (clock, i) for exactly the replicas with unfinished
    requests, so the one furthest behind in simulated time steps next; ``finishes`` holds
    the finish times the router's ``states`` have not yet been told of (the router may
    only know what has happened by the time it routes)."""

    def __init__(self, engines: list[LLMEngine]) -> None:
        n = len(engines)
        self.engines = engines
        self.states = [ReplicaState(str(i)) for i in range(n)]
        self.counts = [0] * n
        self.busy = [0.0] * n
        self.steps = [0] * n
        self.summaries: list[RequestSummary] = []
        self.ready: list[tuple[float, int]] = []     # (clock, replica) of every replica with work
        self.finishes: list[tuple[float, int]] = []  # (finish time, replica) not yet told to the router

    def tell_finished_by(self, t: float) -> None:
        """Lower ``outstanding`` for what has finished by ``t``, and only that."""
        while self.finishes and self.finishes[0][0] <= t:
            self.states[heapq.heappop(self.finishes)[1]].outstanding -= 1

    def add(self, i: int, request: WorkloadRequest) -> None:
        """Give ``request`` to replica ``i`` at its arrival time."""
        t = request.arrival_time
        engine = self.engines[i]
        if not engine.has_unfinished_requests():  # idle: it waited for this arrival
            engine.clock.advance(t - engine.clock())  # (never backwards: mid-step, it stays)
            heapq.heappush(self.ready, (engine.clock(), i))
        engine.add_request(request.request_id, {"prompt_token_ids": request.prompt_token_ids},
                           request.sampling_params(), arrival_time=t, priority=request.priority)
        self.states[i].outstanding += 1
        self.counts[i] += 1

    def step_next(self) -> None:
        """One step of the busy replica furthest behind in simulated time."""
        start, i = heapq.heappop(self.ready)
        engine = self.engines[i]
        outputs = engine.step()
        end = engine.clock()
        self.busy[i] += end - start
        self.steps[i] += 1
        for out in outputs:
            if out.finished:
                heapq.heappush(self.finishes, (end, i))
                self.summaries.append(_summary(out, i))
                engine.trace.requests.pop(out.request_id, None)  # the summary is all we keep
        if engine.has_unfinished_requests():
            heapq.heappush(self.ready, (end, i))

    def replica_summaries(self) -> list[ReplicaSummary]:
        replicas = []
        for i, engine in enumerate(self.engines):
            kv = engine.kv_cache_manager
            stats = kv.prefix_cache_stats
            replicas.append(ReplicaSummary(
                num_requests=self.counts[i], prefix_queries=stats.queries, prefix_hits=stats.hits,
                busy_seconds=self.busy[i], num_steps=self.steps[i],
                num_preemptions=engine.scheduler.num_preemptions,
                free_blocks_after=kv.block_pool.get_num_free_blocks(), num_blocks=kv.num_blocks))
        return replicas


def _summary(out, replica: int) -> RequestSummary:
    m = out.metrics
    return RequestSummary(
        request_id=out.request_id, replica=replica, arrival_time=m.arrival_time,
        first_scheduled_time=m.first_scheduled_time, first_token_time=m.first_token_time,
        finished_time=m.finished_time, num_prompt_tokens=m.num_prompt_tokens,
        num_cached_tokens=m.num_cached_tokens, num_output_tokens=len(out.outputs[0].token_ids))


def sweep(
    make_workload: Callable[[int], Iterable[WorkloadRequest]],
    replica_counts: Sequence[int],
    policies: Sequence[str],
    cost_model: CostModel | None = None,
    on_result: Callable[[ClusterResult], None] | None = None,
    **config: object,
) -> list[SweepRow]:
    """Every policy at every replica count, ``make_workload(num_replicas)`` giving each
    run its requests (scale the arrival rate with the replica count to keep the load per
    replica equal). Returns one :class:`SweepRow` per run; ``on_result`` sees each full
    :class:`ClusterResult` as it comes (to print it, or check it), and then it is dropped."""
    rows = []
    for n in replica_counts:
        for name in policies:
            res = simulate_cluster(make_workload(n), n, name, cost_model=cost_model, **config)
            if on_result is not None:
                on_result(res)
            rows.append(res.row())
    return rows
