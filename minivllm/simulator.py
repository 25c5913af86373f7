"""The simulated model runner: the real scheduler, block manager and trace, no model.

The interesting behaviour of a serving engine (queues building up as the request rate
rises, memory pressure, preemption storms) needs thousands of requests, and real forward
passes serve far fewer in a minute on a CPU (``minivllm bench throughput`` measures how
many on yours). So the engine has two runners and one scheduler, and this module
replaces only the forward pass: :class:`SimulatedModelRunner` has the same
``execute_model(sched) -> ModelRunnerOutput`` as the real :class:`ModelRunner`, returns
one token per sampling request, and advances a :class:`VirtualClock` by the time a
:class:`CostModel` predicts for that step. The engine reads every timestamp from that
clock, so ``Scheduler``, ``KVCacheManager``, ``Trace`` and the request metrics are the
real objects doing the real bookkeeping, in simulated seconds (notebook 09).

The cost model is linear in what a step computes::

    step time = a + b * prefill_tokens + c * decode_requests
                  + d * decode_context + e * prefill_attention

(``decode_context``: sum of the context lengths the decodes attend over;
``prefill_attention``: query-key pairs of the prompt chunks, in thousands). It is fitted
by least squares to steps measured on the real runner (:func:`fit_cost_model`; the whole
measure-fit-check loop is :mod:`minivllm.simulator_fit`) and shipped in
``minivllm/data/cost_model_smollm2_cpu.json`` together with the command that produced
it: ``minivllm bench fit-simulator``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from minivllm.core.kv_cache_manager import cdiv
from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine import DEFAULT_KV_CACHE_MEMORY, EngineConfig, LLMEngine
from minivllm.model_loader import make_tiny_model
from minivllm.model_runner import ModelRunnerOutput
from minivllm.replay import replay_workload
from minivllm.trace import StepRecord, Trace

FEATURES = ("const", "prefill_tokens", "decode_requests", "decode_context", "prefill_attention")
DEFAULT_COST_MODEL = "cost_model_smollm2_cpu.json"


def step_features(chunks: Iterable) -> list[float]:
    """The cost model's inputs for one step. ``chunks`` are the scheduler's
    ``ScheduledRequest`` (``num_new_tokens``) or the trace's ``ScheduledChunk``
    (``num_tokens``); both carry ``num_computed_tokens`` and ``is_prefill``."""
    prefill = decodes = context = attention = 0.0
    for c in chunks:
        n = c.num_new_tokens if hasattr(c, "num_new_tokens") else c.num_tokens
        if c.is_prefill:
            prefill += n
            # each new query attends to the cached tokens and to the new ones before it
            attention += n * (c.num_computed_tokens + (n + 1) / 2) / 1000
        else:
            decodes += 1
            context += c.num_computed_tokens + 1
    return [1.0, prefill, decodes, context, attention]


@dataclass
class CostModel:
    """Predicted seconds of one engine step, linear in :data:`FEATURES`."""

    coefficients: dict[str, float]
    meta: dict = field(default_factory=dict)
    """Where it came from: model, machine, engine settings, fit quality, command."""

    def predict_features(self, features: Sequence[float]) -> float:
        t = sum(self.coefficients[name] * x for name, x in zip(FEATURES, features))
        return max(t, 1e-6)  # a step never takes negative time, whatever the fit says

    def predict(self, chunks: Iterable) -> float:
        return self.predict_features(step_features(chunks))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        """Load a fitted model; default: the one shipped with minivllm."""
        if path is None:
            text = resources.files("minivllm").joinpath("data", DEFAULT_COST_MODEL).read_text()
        else:
            text = Path(path).read_text()
        data = json.loads(text)
        return cls(coefficients=data["coefficients"], meta=data.get("meta", {}))


def step_intervals(trace: Trace) -> list[tuple[StepRecord, float]]:
    """Each step with the wall time it really cost: from its start to the next step's
    start (so the engine's work between steps counts too), or to its own end when the
    engine went idle after it (the gap was waiting for arrivals, not work)."""
    steps = list(trace.steps)
    out = []
    for step, nxt in zip(steps, steps[1:] + [None]):
        busy = nxt is not None and (step.num_running or step.num_waiting)
        out.append((step, (nxt.start - step.start) if busy else step.duration))
    return out


def fit_cost_model(traces: Sequence[Trace], meta: dict | None = None) -> CostModel:
    """Least-squares fit of the step cost (see :func:`step_intervals`) over the steps of
    one or more real-runner traces."""
    rows, y = [], []
    for trace in traces:
        for step, seconds in step_intervals(trace):
            rows.append(step_features(step.scheduled))
            y.append(seconds)
    x, y = np.asarray(rows), np.asarray(y)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    meta = dict(meta or {})
    meta["fit"] = {
        "num_steps": len(y),
        "total_measured_s": float(y.sum()),
        "total_predicted_s": float(pred.sum()),
        "rmse_s": float(np.sqrt(np.mean((pred - y) ** 2))),
        "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-12)),
    }
    return CostModel({name: float(c) for name, c in zip(FEATURES, coef)}, meta)


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
    """Drop-in for :class:`~minivllm.model_runner.ModelRunner` without a model.

    Every request that samples this step gets ``token_id`` (use ``ignore_eos`` so lengths
    are exactly ``max_tokens``); the clock advances by the predicted step time, all of it
    reported as ``model_time``.
    """

    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = 0) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.token_id = token_id

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        seconds = self.cost_model.predict(sched.scheduled)
        self.clock.advance(seconds)
        sampled = {s.request.request_id: self.token_id for s in sched.scheduled if s.samples}
        return ModelRunnerOutput(sampled=sampled, model_time=seconds)


def make_simulated_engine(cost_model: CostModel | None = None, **config: object) -> LLMEngine:
    """An :class:`LLMEngine` whose runner is simulated and whose clock is virtual.

    ``config`` takes :class:`EngineConfig` fields; defaults are the engine's, and the KV
    block count is what the real model (described in the cost model's ``meta``) would get
    from the same settings. The engine is built around a one-layer random model of width
    8 (so the few-MB KV cache it allocates is never used), then its ``model_runner`` is
    swapped for the simulated one: no edit to the engine was needed.
    """
    cost_model = cost_model or CostModel.load()
    meta = cost_model.meta
    # "torch" linear layers: the stand-in model never computes, so there is nothing to measure.
    cfg = EngineConfig(**{"log_stats_interval": None, "device": "cpu", "linear_backend": "torch", **config})
    model_max = int(meta.get("max_position_embeddings", 8192))
    if cfg.num_kv_blocks is None:  # same arithmetic as LLMEngine, with the real model's sizes
        block_bytes = int(meta.get("kv_bytes_per_token", 46080)) * cfg.block_size
        num_blocks = (cfg.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // block_bytes
        if cfg.kv_cache_memory is None:
            num_blocks = min(num_blocks, cfg.max_num_seqs * cdiv(cfg.max_model_len or model_max, cfg.block_size))
        cfg.num_kv_blocks = num_blocks
    if cfg.max_model_len is None:
        cfg.max_model_len = min(model_max, cfg.num_kv_blocks * cfg.block_size)
    tiny = make_tiny_model(
        "llama", vocab_size=int(meta.get("vocab_size", 49152)), hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        max_position_embeddings=max(model_max, cfg.max_model_len),
    )
    clock = VirtualClock()
    engine = LLMEngine(cfg, tiny, tokenizer=None, clock=clock)
    token = (engine.eos_token_id or 0) + 1
    engine.model_runner = SimulatedModelRunner(cost_model, clock, token_id=token)
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
