"""The simulated model runner: the real scheduler, block manager and trace, no model.

The interesting behaviour of a serving engine (queues building up as the request rate
rises, memory pressure, preemption storms) needs thousands of requests, and real forward
passes serve far fewer in a minute on a CPU (``minivllm bench throughput`` measures how
many on yours). So the engine has two runners and one scheduler, and this module
replaces only the forward pass: :class:`SimulatedModelRunner` has the same
``execute_model(scheduler_output) -> ModelRunnerOutput`` as the real :class:`ModelRunner`, returns
one token per sampling request, and advances a :class:`VirtualClock` by the time a
:class:`CostModel` predicts for that step. The engine reads every timestamp from that
clock, so ``Scheduler``, ``KVCacheManager``, ``Trace`` and the request metrics are the
real objects doing the real bookkeeping, in simulated seconds (notebook 09).

What a step costs, and how that is fitted and calibrated per machine, is
:mod:`minivllm.sim.cost_model`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from minivllm.config import EngineConfig
from minivllm.core.kv_cache_utils import size_kv_cache
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.kv_transfer.base import KVConnectorOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor.abstract import eos_token_id
from minivllm.sim.cost_model import CostModel
from minivllm.sim.replay import replay_workload
from minivllm.worker.model_loader import make_tiny_model
from minivllm.worker.model_runner import ModelRunnerOutput


class VirtualClock:
    """A clock that only moves when told to: simulated seconds since the start."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.now += seconds


class SimulatedModelRunner:
    """Drop-in for :class:`~minivllm.worker.model_runner.ModelRunner` without a model.

    Every request that samples this step gets ``token_id`` (use ``ignore_eos`` so lengths
    are exactly ``max_tokens``); the clock advances by the predicted step time, all of it
    reported as ``model_time``.
    """

    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = 0) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.token_id = token_id

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        seconds = self.cost_model.predict(scheduler_output.scheduled)
        self.clock.advance(seconds)
        sampled = {s.request.request_id: [self.token_id] for s in scheduler_output.scheduled if s.samples}
        # An empty connector output: a simulated engine may carry a stand-in KV connector
        # (the disaggregated simulator's), whose loads always succeed.
        return ModelRunnerOutput(sampled=sampled, model_time=seconds, kv_connector_output=KVConnectorOutput())

    def remove_requests(self, request_ids: list[str]) -> None:
        """Nothing to forget: this runner keeps no per-request state."""


@functools.lru_cache(maxsize=4)
def stand_in_model(vocab_size: int, max_position_embeddings: int) -> torch.nn.Module:
    """The simulated engine's model: one layer of width 8, never run. Shared by every
    simulated engine of the same vocabulary and length (a sweep makes hundreds of
    engines, and building a random model each time cost about a tenth of the sweep)."""
    return make_tiny_model(
        "llama", vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=max_position_embeddings,
    )


def make_simulated_engine(cost_model: CostModel | None = None, **config: object) -> LLMEngine:
    """An :class:`LLMEngine` whose runner is simulated and whose clock is virtual.

    ``config`` takes :class:`EngineConfig` fields; defaults are the engine's, and the KV
    cache is sized by the engine's own :func:`~minivllm.core.kv_cache_utils.size_kv_cache` from the
    sizes of the real model (the cost model's ``meta``). The engine gets the simulated
    runner as its ``model_runner``, so no KV cache is allocated; it still needs a model
    for its vocabulary size and EOS token: a one-layer random model of width 8.
    Without a ``cost_model``: this machine's calibration, else the shipped one (warned).
    The trace's ``time_source`` names the model, for every figure drawn from it.
    """
    if cost_model is None:
        names = ("model", "dtype", "attention_backend", "linear_backend")
        cost_model = CostModel.for_this_machine(**{k: config[k] for k in names if k in config})
    meta = cost_model.meta
    # The stand-in model never computes, so its linear layers have no library to choose:
    # ``linear_backend`` only picks the cost model (above).
    cfg = EngineConfig(**{"log_stats_interval": None, "device": "cpu", **config, "linear_backend": "torch"})
    model_max_len = int(meta.get("max_position_embeddings", 8192))
    size = size_kv_cache(cfg, int(meta.get("kv_bytes_per_token", 46080)), model_max_len)
    cfg.num_kv_blocks, cfg.max_model_len = size.num_blocks, size.max_model_len
    tiny = stand_in_model(int(meta.get("vocab_size", 49152)), model_max_len)
    clock = VirtualClock()
    token = (eos_token_id(tiny, None) or 0) + 1  # never EOS: lengths are exactly max_tokens
    runner = SimulatedModelRunner(cost_model, clock, token_id=token)
    engine = LLMEngine(cfg, tiny, tokenizer=None, clock=clock, model_runner=runner)
    engine.trace.time_source = f"simulated ({cost_model.label})"
    return engine


def current_rss_bytes() -> int | None:
    """Resident memory of this process now (Linux), None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class SimulationResult:
    num_requests: int
    num_finished: int
    simulated_seconds: float
    wall_seconds: float
    output_tokens: int
    num_steps: int
    num_preemptions: int
    free_blocks_after: int
    num_blocks: int
    ttft: list[float]
    e2e: list[float]
    tpot: list[float]
    rss_samples: list[tuple[int, int]]
    """(requests finished, RSS bytes) every ``rss_every`` finished requests."""

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second."""
        return self.output_tokens / self.simulated_seconds if self.simulated_seconds else 0.0

    @property
    def no_block_leaked(self) -> bool:
        return self.free_blocks_after == self.num_blocks


def simulate(workload: Iterable, engine: LLMEngine | None = None, rss_every: int = 1000,
             **config: object) -> SimulationResult:
    """Replay a workload (arrival times honoured, in simulated seconds) on a simulated
    engine and keep only per-request summaries, so memory stays flat however many
    requests flow through. ``config``: :class:`EngineConfig` fields, when no engine is given.
    """
    engine = engine or make_simulated_engine(max_trace_steps=config.pop("max_trace_steps", 200), **config)
    ttft, e2e, tpot, rss = [], [], [], []
    counts = {"n": 0, "tokens": 0}

    def on_finished(out) -> None:
        m = out.metrics
        ttft.append(m.ttft)
        e2e.append(m.e2e_latency)
        if m.tpot is not None:
            tpot.append(m.tpot)
        counts["tokens"] += len(out.outputs[0].token_ids)
        counts["n"] += 1
        engine.trace.requests.pop(out.request_id, None)  # the summaries above are all we keep
        if rss_every and counts["n"] % rss_every == 0:
            rss.append((counts["n"], current_rss_bytes() or 0))

    wall = time.perf_counter()
    start = engine.clock()
    res = replay_workload(engine, workload, on_finished=on_finished, keep_outputs=False)
    kv = engine.kv_cache_manager
    return SimulationResult(
        num_requests=res.num_added,
        num_finished=counts["n"],
        simulated_seconds=engine.clock() - start,
        wall_seconds=time.perf_counter() - wall,
        output_tokens=counts["tokens"],
        num_steps=res.num_steps,
        num_preemptions=engine.scheduler.num_preemptions,
        free_blocks_after=kv.block_pool.get_num_free_blocks(),
        num_blocks=kv.num_blocks,
        ttft=ttft, e2e=e2e, tpot=tpot, rss_samples=rss,
    )
