"""Benchmarks: minivllm against the tools a reader would otherwise use, on the same requests.

Every performance sentence in a notebook is one of these functions, re-runnable
(notebooks 02 and 09; the command line is ``minivllm bench ...``):

- :func:`throughput_benchmark`: one offline workload, every request at once, served by
  minivllm, by transformers ``generate()`` one request at a time, by padded static
  batches (left padding plus attention mask), and by transformers' own continuous
  batching; same token ids, greedy, ``ignore_eos``; greedy outputs compared token by
  token with minivllm's. Also the engine's overhead: step time outside the model forward.
- :func:`latency_benchmark`: Poisson arrivals at several request rates, the real engine
  driven by the wall clock (or the simulator by its virtual clock); TTFT, ITL and
  end-to-end p50/p99 and throughput against the rate.
- :func:`chunked_prefill_benchmark`: the inter-token-latency spike one long prompt
  causes among running decodes, with chunked prefill off and on.
- :func:`kv_memory_report`: paged blocks against contiguous max-length reservation, by
  arithmetic on the workload.
- :func:`linear_benchmark`: the model's linear layers through ``nn.Linear`` and through
  oneDNN (``minivllm.linear``), on this CPU.
- :func:`fit_simulator`: measure the real runner, fit the simulator's cost model, check
  it on a held-out workload, save it (``minivllm/data/``).

Plot functions take a result and an optional Axes and return the Figure; they never run
anything.
"""

from __future__ import annotations

import argparse
import copy
import logging
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from minivllm.engine import EngineConfig, LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.trace import Trace
from minivllm.workload import WorkloadRequest, chat_workload, make_workload, summarize

logger = logging.getLogger("minivllm")

TOOLS = ("minivllm", "minivllm-torch-linear", "hf-generate", "hf-static", "hf-cb")
TOOL_LABELS = {
    "minivllm": "minivllm (continuous batching, paged KV)",
    "minivllm-torch-linear": "minivllm, linear_backend='torch'",
    "hf-generate": "transformers generate(), one at a time",
    "hf-static": "transformers generate(), padded static batches",
    "hf-cb": "transformers continuous batching",
}
FIGURES = Path("figures")


# -- driving an engine through a workload ------------------------------------------------
@dataclass
class ReplayResult:
    outputs: dict[str, RequestOutput]
    """Final output of each request (empty when ``keep_outputs`` is False)."""
    num_added: int
    num_steps: int
    start: float
    end: float
    """Engine clock at the first arrival and at the last finish."""


def replay(
    engine: LLMEngine,
    workload: Iterable[WorkloadRequest],
    on_finished: Callable[[RequestOutput], None] | None = None,
    keep_outputs: bool = True,
    wait: Callable[[float], None] | None = None,
) -> ReplayResult:
    """Serve a workload the way a server would: add each request once the engine's clock
    passes its arrival time, step while there is work, wait for the next arrival when
    there is none. ``wait`` defaults to ``time.sleep``, or to advancing the clock when it
    is a simulator's virtual clock. Arrival times are recorded as scheduled (open loop),
    so a late add counts against TTFT, as it would for a real client."""
    clock = engine.clock
    if wait is None:
        wait = clock.advance if hasattr(clock, "advance") else time.sleep
    requests = iter(workload)
    pending = next(requests, None)
    outputs: dict[str, RequestOutput] = {}
    t0 = clock()
    added = steps = 0
    while pending is not None or engine.has_unfinished_requests():
        now = clock()
        while pending is not None and t0 + pending.arrival_time <= now:
            engine.add_request(pending.request_id, {"prompt_token_ids": pending.prompt_token_ids},
                               pending.sampling_params(), arrival_time=t0 + pending.arrival_time)
            added += 1
            pending = next(requests, None)
        if engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    if keep_outputs:
                        outputs[out.request_id] = out
                    if on_finished is not None:
                        on_finished(out)
        elif pending is not None:
            wait(t0 + pending.arrival_time - now)
    return ReplayResult(outputs, added, steps, t0, clock())


# -- throughput: the four tools -----------------------------------------------------------
@dataclass
class ToolResult:
    tool: str
    wall_s: float
    output_tokens: int
    token_ids: list[list[int]]
    """Generated token ids per request, in workload order."""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def _quiet_transformers() -> None:
    # eos_token_id=-1 (never stop) is deliberate; transformers warns about it every call.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def run_minivllm(engine: LLMEngine, workload: Sequence[WorkloadRequest]) -> ToolResult:
    """All requests at once through the engine (the trace stays on ``engine.trace``)."""
    ids = {r.request_id for r in workload}
    if len(ids) != len(workload):
        raise ValueError("workload request ids must be unique")
    t = time.perf_counter()
    res = replay(engine, [copy.copy(r) for r in workload])
    wall = time.perf_counter() - t
    tokens = [res.outputs[r.request_id].outputs[0].token_ids for r in workload]
    return ToolResult("minivllm", wall, sum(map(len, tokens)), tokens)


def _gen_config(max_new_tokens: int, pad_token_id: int):
    from transformers import GenerationConfig

    # eos -1: no token ever matches, so exactly max_new_tokens come out (ignore_eos).
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                            eos_token_id=-1, pad_token_id=pad_token_id)


@torch.inference_mode()
def run_hf_generate(model, workload: Sequence[WorkloadRequest], pad_token_id: int = 0) -> ToolResult:
    """transformers ``generate()`` one request at a time: the loop a beginner writes."""
    _quiet_transformers()
    dev = model.device
    tokens = []
    t = time.perf_counter()
    for r in workload:
        ids = torch.tensor([r.prompt_token_ids], device=dev)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             generation_config=_gen_config(r.max_tokens, pad_token_id))
        tokens.append(out[0, ids.shape[1]:].tolist())
    wall = time.perf_counter() - t
    return ToolResult("hf-generate", wall, sum(map(len, tokens)), tokens)


@torch.inference_mode()
def run_hf_static(model, workload: Sequence[WorkloadRequest], batch_size: int = 8,
                  pad_token_id: int = 0) -> ToolResult:
    """Padded static batches in arrival order: left padding plus an attention mask; each
    batch runs until its longest request is done (shorter ones' extra tokens are waste
    and are not counted)."""
    _quiet_transformers()
    dev = model.device
    tokens = []
    t = time.perf_counter()
    for b in range(0, len(workload), batch_size):
        batch = workload[b : b + batch_size]
        width = max(r.num_prompt_tokens for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.num_prompt_tokens :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.num_prompt_tokens :] = 1
        out = model.generate(ids.to(dev), attention_mask=mask.to(dev),
                             generation_config=_gen_config(max(r.max_tokens for r in batch), pad_token_id))
        for i, r in enumerate(batch):
            tokens.append(out[i, width : width + r.max_tokens].tolist())
    wall = time.perf_counter() - t
    return ToolResult("hf-static", wall, sum(map(len, tokens)), tokens)


@torch.inference_mode()
def run_hf_continuous(model, workload: Sequence[WorkloadRequest], page_size: int = 16,
                      max_batch_tokens: int = 512, num_blocks: int | None = None,
                      pad_token_id: int = 0) -> ToolResult:
    """transformers' own continuous batching (``ContinuousBatchingManager``) with a
    paged cache sized for the whole workload and minivllm's token budget. Its warm-up
    runs before the clock starts."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    _quiet_transformers()
    if num_blocks is None:
        num_blocks = sum(-(-(r.num_prompt_tokens + r.max_tokens) // page_size) for r in workload) + 16
    cfg = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size,
                                   max_batch_tokens=max_batch_tokens, use_cuda_graph=False,
                                   auto_switch_to_flash=False)
    gen = _gen_config(max(r.max_tokens for r in workload), pad_token_id)
    results = {}
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cfg) as mgr:
        t = time.perf_counter()
        for r in workload:
            mgr.add_request(list(r.prompt_token_ids), request_id=f"req-{r.request_id}",
                            max_new_tokens=r.max_tokens, eos_token_id=-1)
        while len(results) < len(workload):
            out = mgr.get_result(timeout=1)
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"transformers CB failed on {out.request_id}: {out.error}")
                results[out.request_id] = out
            elif out is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        wall = time.perf_counter() - t
    tokens = [list(results[f"req-{r.request_id}"].generated_tokens) for r in workload]
    return ToolResult("hf-cb", wall, sum(map(len, tokens)), tokens)


def engine_overhead(trace: Trace, min_running: int = 32) -> dict[str, float]:
    """Share of step time spent outside the model forward (and sampler), over the steps
    that ran at least ``min_running`` requests. ``in_step``: within ``step()`` as the trace
    times it; ``per_iteration``: from one step's start to the next's, so the output objects
    built after a step count too."""
    steps = list(trace.steps)
    sel = [(s, n) for s, n in zip(steps, steps[1:] + [None]) if len(s.scheduled) >= min_running]
    if not sel:
        return {"num_steps": 0, "in_step": float("nan"), "per_iteration": float("nan")}
    dur = sum(s.duration for s, _ in sel)
    model = sum(s.model_time for s, _ in sel)
    with_next = [(s, n) for s, n in sel if n is not None]
    iteration = sum(n.start - s.start for s, n in with_next)
    model_it = sum(s.model_time for s, _ in with_next)
    return {
        "num_steps": len(sel),
        "mean_step_s": dur / len(sel),
        "in_step": 1 - model / dur if dur else float("nan"),
        "per_iteration": 1 - model_it / iteration if iteration else float("nan"),
    }


@dataclass
class ThroughputReport:
    workload: dict
    results: list[ToolResult]
    matches: dict[str, int]
    """Per tool: requests whose greedy tokens equal minivllm's exactly."""
    first_mismatch: dict[str, list[tuple[str, int]]]
    """Per tool: (request id, first differing position) of the requests that differ."""
    overhead: dict[str, float] = field(default_factory=dict)
    environment: dict = field(default_factory=dict)

    def result(self, tool: str) -> ToolResult | None:
        return next((r for r in self.results if r.tool == tool), None)

    def table(self) -> str:
        base = self.result("hf-generate")
        n = self.workload["num_requests"]
        lines = [f"{'tool':<44} {'wall s':>8} {'out tok/s':>10} {'vs 1-at-a-time':>15} {'same as minivllm':>17}"]
        for r in self.results:
            ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
            same = f"{self.matches.get(r.tool, n)}/{n}"
            lines.append(f"{TOOL_LABELS.get(r.tool, r.tool):<44} {r.wall_s:>8.2f} {r.tokens_per_s:>10.1f} {ratio:>15} {same:>17}")
        if self.overhead.get("num_steps"):
            o = self.overhead
            lines.append(
                f"engine overhead at >= {o['min_running']} running requests ({o['num_steps']} steps, "
                f"mean step {o['mean_step_s'] * 1e3:.1f} ms): {o['in_step']:.1%} of step time, "
                f"{o['per_iteration']:.1%} of each iteration"
            )
        return "\n".join(lines)


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def throughput_benchmark(
    workload: Sequence[WorkloadRequest],
    model: str | torch.nn.Module = "smollm2-135m-instruct",
    tokenizer=None,
    tools: Sequence[str] = TOOLS,
    static_batch_size: int = 8,
    engine_kwargs: dict | None = None,
    min_running: int = 32,
) -> ThroughputReport:
    """Serve ``workload`` with each tool in ``tools`` (minivllm always runs: it is the
    reference for the greedy-identity check) and compare. ``model`` is an embedded model
    name or a loaded transformers model (copied for the baselines, as the engine
    installs its own attention function on the one it gets)."""
    from minivllm.model_loader import load_model

    unknown = set(tools) - set(TOOLS)
    if unknown:
        raise ValueError(f"unknown tools {sorted(unknown)}; choose from {TOOLS}")
    workload = list(workload)
    kwargs = {"log_stats_interval": None, **(engine_kwargs or {})}
    if isinstance(model, str):
        engine = LLMEngine(EngineConfig(model=model, **kwargs))
        baseline = load_model(model)[0] if any(t.startswith("hf-") for t in tools) else None
        tokenizer = tokenizer or engine.tokenizer
    else:
        baseline = copy.deepcopy(model)
        engine = LLMEngine(EngineConfig(**kwargs), model, tokenizer)
    pad = 0
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # A short warm-up of each path, outside the timings (first calls allocate and compile).
    warm = make_workload(None, 2, seed=99, prompt_len=(8, 16), output_len=4, vocab_size=100)
    for w in warm:
        w.request_id = f"warmup-{w.request_id}"
    run_minivllm(engine, warm)
    engine.trace.clear()
    results = [run_minivllm(engine, workload)]
    if baseline is not None:
        baseline.set_attn_implementation("sdpa")
        run_hf_generate(baseline, warm[:1], pad)
    logger.info("minivllm: %.1f s", results[0].wall_s)
    for tool in tools:
        if tool == "minivllm-torch-linear":
            # The same engine with the model's nn.Linear as is: how much of minivllm's lead
            # is scheduling and paging, and how much the oneDNN matmul (minivllm.linear).
            stock = LLMEngine(EngineConfig(**{**kwargs, "linear_backend": "torch"}), engine.model, tokenizer)
            run_minivllm(stock, warm)
            results.append(replace(run_minivllm(stock, workload), tool=tool))
        elif tool == "hf-generate":
            results.append(run_hf_generate(baseline, workload, pad))
        elif tool == "hf-static":
            results.append(run_hf_static(baseline, workload, static_batch_size, pad))
        elif tool == "hf-cb":
            results.append(run_hf_continuous(baseline, workload, pad_token_id=pad,
                                             max_batch_tokens=engine.config.max_num_batched_tokens))
        if tool != "minivllm":
            logger.info("%s: %.1f s", tool, results[-1].wall_s)
    ref = results[0].token_ids
    matches, mism = {}, {}
    for r in results[1:]:
        diffs = [(w.request_id, _first_diff(a, b)) for w, a, b in zip(workload, ref, r.token_ids)]
        diffs = [(rid, i) for rid, i in diffs if i >= 0]
        matches[r.tool] = len(workload) - len(diffs)
        mism[r.tool] = diffs
    overhead = {**engine_overhead(engine.trace, min_running), "min_running": min_running}
    env = {
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "device": str(engine.device),
        "attention_backend": engine.attention_backend,
        "linear_backend": engine.linear_backend,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
    }
    return ThroughputReport(summarize(workload), results, matches, mism, overhead, env)


def plot_throughput(report: ThroughputReport, ax=None):
    """Bar chart of output tokens/s per tool, annotated with the ratio to one-at-a-time."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.2))
    else:
        fig = ax.figure
    res = report.results[::-1]
    base = report.result("hf-generate")
    y = np.arange(len(res))
    colors = ["tab:green" if r.tool.startswith("minivllm") else "tab:gray" for r in res]
    ax.barh(y, [r.tokens_per_s for r in res], color=colors)
    ax.set_yticks(y, [TOOL_LABELS.get(r.tool, r.tool) for r in res], fontsize=8)
    for yi, r in zip(y, res):
        note = f" {r.tokens_per_s:.0f} tok/s"
        if base:
            note += f" ({r.tokens_per_s / base.tokens_per_s:.1f}x)"
        ax.text(r.tokens_per_s, yi, note, va="center", fontsize=8)
    ax.set_xlim(0, max(r.tokens_per_s for r in res) * 1.35)
    w = report.workload
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title(f"{w['num_requests']} chat requests, {w['prompt_tokens']} prompt + "
                 f"{w['output_tokens']} output tokens, greedy", fontsize=9)
    fig.tight_layout()
    return fig


# -- latency against request rate ---------------------------------------------------------
def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


@dataclass
class LatencyPoint:
    rate: float
    num_requests: int
    duration_s: float
    """First arrival to last finish."""
    throughput: float
    """Output tokens per second over that span."""
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    e2e_p99: float
    simulated: bool = False


def latency_point(outputs: Iterable[RequestOutput], rate: float, start: float, end: float,
                  simulated: bool = False) -> LatencyPoint:
    outs = list(outputs)
    ttft = [o.metrics.ttft for o in outs]
    e2e = [o.metrics.e2e_latency for o in outs]
    itl = [x for o in outs for x in o.metrics.itls]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    span = end - start
    return LatencyPoint(rate, len(outs), span, tokens / span if span else 0.0,
                        _pct(ttft, 50), _pct(ttft, 99), _pct(itl, 50), _pct(itl, 99),
                        _pct(e2e, 50), _pct(e2e, 99), simulated)


def latency_benchmark(
    make_engine: Callable[[], LLMEngine],
    rates: Sequence[float],
    tokenizer=None,
    n: int = 16,
    seed: int = 0,
    **workload_kwargs,
) -> list[LatencyPoint]:
    """For each rate, a workload of ``n`` requests with Poisson arrivals at that rate
    (same prompts and lengths at every rate; only the arrivals change), served by a fresh
    engine from ``make_engine`` (real: driven by the wall clock; simulated: by its virtual
    clock, see :func:`minivllm.simulator.make_simulated_engine`)."""
    points = []
    for rate in rates:
        engine = make_engine()
        workload = make_workload(tokenizer, n, seed, rate=rate, **workload_kwargs)
        res = replay(engine, workload)
        simulated = hasattr(engine.clock, "advance")
        points.append(latency_point(res.outputs.values(), rate, res.start, res.end, simulated))
    return points


def format_latency_table(points: Sequence[LatencyPoint]) -> str:
    lines = [f"{'rate req/s':>10} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
             f"{'ITL p99':>8} {'e2e p50':>8} {'e2e p99':>8}   (seconds)"]
    for p in points:
        lines.append(f"{p.rate:>10.2f} {p.throughput:>7.1f} {p.ttft_p50:>9.3f} {p.ttft_p99:>9.3f} "
                     f"{p.itl_p50:>8.3f} {p.itl_p99:>8.3f} {p.e2e_p50:>8.2f} {p.e2e_p99:>8.2f}")
    return "\n".join(lines)


def plot_latency(points: Sequence[LatencyPoint], axes=None):
    """TTFT, ITL and end-to-end p50/p99 and throughput against the request rate."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 4, figsize=(12, 3))
    else:
        fig = axes[0].figure
    rates = [p.rate for p in points]
    for ax, key, title in zip(axes, ("ttft", "itl", "e2e"), ("TTFT", "ITL", "end-to-end")):
        ax.plot(rates, [getattr(p, f"{key}_p50") for p in points], "o-", label="p50")
        ax.plot(rates, [getattr(p, f"{key}_p99") for p in points], "s--", label="p99")
        ax.set_title(f"{title} (s)", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=8)
    axes[3].plot(rates, [p.throughput for p in points], "o-", color="tab:green")
    axes[3].set_title("output tokens / s", fontsize=9)
    axes[3].set_xlabel("request rate (req/s)")
    fig.tight_layout()
    return fig


# -- chunked prefill: one long prompt among decodes ---------------------------------------
@dataclass
class ChunkedPrefillResult:
    label: str
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    decode_itls: list[float]
    """Every inter-token gap of the short requests, in order of time."""
    itl_times: list[float]
    """When each of those gaps ended (seconds from the start)."""
    long_ttft: float
    long_arrival: float

    @property
    def max_itl(self) -> float:
        return max(self.decode_itls)

    @property
    def median_itl(self) -> float:
        return float(np.median(self.decode_itls))


def chunked_prefill_benchmark(
    make_engine: Callable[..., LLMEngine],
    num_decodes: int = 8,
    decode_prompt_len: int = 48,
    decode_tokens: int = 48,
    long_prompt_len: int = 1024,
    inject_after_steps: int = 8,
    chunk_budget: int = 256,
    tokenizer=None,
    vocab_size: int = 512,
) -> list[ChunkedPrefillResult]:
    """``num_decodes`` short requests decode; after ``inject_after_steps`` steps a prompt
    of ``long_prompt_len`` tokens arrives. Without chunking its whole prefill is one step
    (the budget is raised to hold it and the decodes), and every decode waits for it; with chunking it is cut into
    ``chunk_budget``-token chunks that share steps with the decodes.
    ``make_engine(max_num_batched_tokens=..., enable_chunked_prefill=...)`` builds each engine."""
    kw = dict(prompt_len=decode_prompt_len, output_len=decode_tokens, vocab_size=vocab_size)
    short = make_workload(tokenizer, num_decodes, seed=1, **kw)
    long = make_workload(tokenizer, 1, seed=2, prompt_len=long_prompt_len, output_len=4, vocab_size=vocab_size)[0]
    long.request_id = "long"
    out = []
    # Off: the budget must hold the whole prompt *and* the running decodes, or the prompt
    # would wait until every decode finished (the scheduler serves running requests first).
    off_budget = max(long_prompt_len + num_decodes, chunk_budget)
    for label, chunked, budget in (("chunked prefill off", False, off_budget),
                                   (f"chunked prefill on ({chunk_budget}-token budget)", True, chunk_budget)):
        engine = make_engine(max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        t0 = engine.clock()
        for r in short:
            engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, r.sampling_params())
        done: dict[str, RequestOutput] = {}
        steps = 0
        while engine.has_unfinished_requests():
            if steps == inject_after_steps:
                engine.add_request("long", {"prompt_token_ids": long.prompt_token_ids}, long.sampling_params())
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            steps += 1
        itls, times = [], []
        for r in short:
            m = done[r.request_id].metrics
            itls.extend(m.itls)
            times.extend(t - t0 for t in m.token_times[1:])
        order = np.argsort(times)
        lm = done["long"].metrics
        out.append(ChunkedPrefillResult(label, budget, chunked, [itls[i] for i in order],
                                        [times[i] for i in order], lm.ttft, lm.arrival_time - t0))
    return out


def plot_chunked_prefill(results: Sequence[ChunkedPrefillResult], ax=None):
    """Inter-token gaps of the running decodes over time, one line per setting."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3))
    else:
        fig = ax.figure
    for r in results:
        ax.plot(r.itl_times, np.array(r.decode_itls) * 1e3, ".-", label=f"{r.label}: max {r.max_itl * 1e3:.0f} ms")
        ax.axvline(r.long_arrival, color="gray", ls=":", lw=1)
    ax.set_xlabel("time (s); dotted: the long prompt arrives")
    ax.set_ylabel("inter-token latency (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# -- memory: paged against contiguous ------------------------------------------------------
def kv_memory_report(
    workload: Sequence[WorkloadRequest],
    block_size: int = 16,
    max_model_len: int = 2048,
    kv_bytes_per_token: int = 46080,
    kv_cache_memory: int = 1 << 30,
) -> dict[str, float]:
    """KV cache a workload needs, two ways, by arithmetic (every request at its full
    length, prompt plus ``max_tokens``):

    - contiguous: each request reserves ``max_model_len`` slots up front, as a server that
      does not know the output length must;
    - paged: each request holds ``ceil(length / block_size)`` blocks; only the last one is
      partly empty.

    Also how many of these requests fit at once in ``kv_cache_memory`` bytes each way
    (paged: requests taken in workload order, cycling, until the blocks run out).
    ``kv_bytes_per_token`` defaults to SmolLM2-135M in float32 (30 layers x 3 KV heads x
    64 dims x K and V x 4 bytes)."""
    lengths = [r.num_prompt_tokens + r.max_tokens for r in workload]
    if not lengths:
        raise ValueError("the workload is empty")
    too_long = [n for n in lengths if n > max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests are longer than max_model_len {max_model_len}")
    used = sum(lengths)
    paged = sum(-(-n // block_size) * block_size for n in lengths)
    contiguous = len(lengths) * max_model_len
    capacity = kv_cache_memory // kv_bytes_per_token
    blocks = capacity // block_size
    fit_paged, i = 0, 0
    while True:
        need = -(-lengths[i % len(lengths)] // block_size)
        if need > blocks:
            break
        blocks -= need
        fit_paged += 1
        i += 1
    return {
        "num_requests": len(lengths),
        "tokens_used": used,
        "paged_slots": paged,
        "contiguous_slots": contiguous,
        "paged_waste": 1 - used / paged,
        "contiguous_waste": 1 - used / contiguous,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_cache_memory": kv_cache_memory,
        "capacity_tokens": capacity,
        "fit_contiguous": capacity // max_model_len,
        "fit_paged": fit_paged,
    }


def format_memory_report(m: dict) -> str:
    mib = m["kv_bytes_per_token"] / 2**20
    return "\n".join([
        f"{m['num_requests']} requests, {m['tokens_used']} tokens of KV at full length "
        f"({m['tokens_used'] * mib:.0f} MiB)",
        f"contiguous ({m['max_model_len']} slots each): {m['contiguous_slots']} slots, "
        f"{m['contiguous_slots'] * mib:.0f} MiB, {m['contiguous_waste']:.1%} wasted",
        f"paged (blocks of {m['block_size']}):       {m['paged_slots']} slots, "
        f"{m['paged_slots'] * mib:.0f} MiB, {m['paged_waste']:.1%} wasted",
        f"in {m['kv_cache_memory'] / 2**20:.0f} MiB ({m['capacity_tokens']} tokens): "
        f"{m['fit_contiguous']} requests fit contiguous, {m['fit_paged']} paged "
        f"({m['fit_paged'] / max(m['fit_contiguous'], 1):.1f}x)",
    ])


def plot_memory(m: dict, ax=None):
    """Stacked bars: KV slots used and wasted, contiguous against paged."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 2.6))
    else:
        fig = ax.figure
    mib = m["kv_bytes_per_token"] / 2**20
    used = m["tokens_used"] * mib
    labels = [f"contiguous ({m['max_model_len']} each)", f"paged (block {m['block_size']})"]
    totals = [m["contiguous_slots"] * mib, m["paged_slots"] * mib]
    ax.barh(labels, [used, used], color="tab:green", label="holds a token")
    ax.barh(labels, [t - used for t in totals], left=[used, used], color="tab:red", alpha=0.6,
            label="reserved, empty")
    for y, t in enumerate(totals):
        ax.text(t, y, f" {t:.0f} MiB ({1 - used / t:.0%} waste)", va="center", fontsize=8)
    ax.set_xlim(0, max(totals) * 1.4)
    ax.set_xlabel(f"KV cache for {m['num_requests']} requests (MiB)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


# -- the simulator's cost model ------------------------------------------------------------
def fit_simulator(
    model: str = "smollm2-135m-instruct",
    fit_seeds: Sequence[int] = (1, 3),
    heldout_seed: int = 2,
    n: int = 32,
    fit_rate: float = 2.0,
    out_path: str | Path | None = None,
    command: str = "",
) -> dict:
    """Measure the real engine, fit the cost model, check it on a held-out workload.

    Fit data: for each seed, ``n`` chat requests all at once and ``n`` more arriving at
    ``fit_rate`` req/s (so steps of every mix of prefill chunks and decodes are seen).
    Two seeds rather than one: on a shared 2-core machine single steps jitter by a few
    milliseconds, and with one seed the held-out error moved between -10% and +14% from
    run to run; with two it was -0.5%, +4.1% and +8.2% in three runs.
    Held out: another ``n``-request workload all at once; its measured wall time is
    compared with the simulator's prediction for the same workload.
    """
    from minivllm.simulator import fit_cost_model, make_simulated_engine

    engine = LLMEngine(EngineConfig(model=model, log_stats_interval=None))
    tok = engine.tokenizer
    run_minivllm(engine, [WorkloadRequest("warmup", [1, 2, 3, 4], 4)])
    traces = []

    def measured(workload: list[WorkloadRequest], tag: str) -> tuple[Trace, float]:
        for r in workload:
            r.request_id = f"{tag}-{r.request_id}"
        engine.trace.clear()
        engine.reset_prefix_cache()
        t = time.perf_counter()
        replay(engine, workload)
        wall = time.perf_counter() - t
        trace = copy.copy(engine.trace)
        trace.steps = copy.copy(engine.trace.steps)
        return trace, wall

    for seed in fit_seeds:
        for rate in (None, fit_rate):
            tr, wall = measured(chat_workload(tok, n, seed, rate=rate), f"fit{seed}-{rate}")
            logger.info("fit run seed %d rate %s: %d steps, %.1f s", seed, rate, len(tr.steps), wall)
            traces.append(tr)
    held_workload = chat_workload(tok, n, heldout_seed)
    held_trace, held_wall = measured(chat_workload(tok, n, heldout_seed), "heldout")

    cfg = engine.config
    from minivllm.model_runner import kv_cache_bytes_per_token

    meta = {
        "model": model,
        "dtype": cfg.dtype,
        "device": str(engine.device),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "attention_backend": engine.attention_backend,
        "linear_backend": engine.linear_backend,
        "block_size": cfg.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "kv_bytes_per_token": kv_cache_bytes_per_token(engine.model, engine.model.dtype),
        "vocab_size": engine.model.config.vocab_size,
        "max_position_embeddings": engine.model.config.max_position_embeddings,
        "fit_workloads": f"chat_workload(n={n}, seed in {list(fit_seeds)}), all at once and at {fit_rate} req/s",
        "command": command,
        "created": time.strftime("%Y-%m-%d"),
    }
    cm = fit_cost_model(traces, meta)
    sim = make_simulated_engine(cm, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_batched_tokens)
    sim_res = replay(sim, held_workload)
    predicted = sim_res.end - sim_res.start
    cm.meta["held_out"] = {
        "workload": f"chat_workload(n={n}, seed={heldout_seed}), all at once",
        "measured_wall_s": held_wall,
        "predicted_s": predicted,
        "error": predicted / held_wall - 1,
        "measured_steps": len(held_trace.steps),
        "simulated_steps": sim_res.num_steps,
    }
    if out_path is not None:
        cm.save(out_path)
    return {"cost_model": cm, "traces": traces, "held_out_trace": held_trace}


def plot_cost_model_fit(cost_model, traces: Sequence[Trace], ax=None):
    """Predicted against measured time of every step the model was fitted on."""
    import matplotlib.pyplot as plt

    from minivllm.simulator import step_intervals

    if ax is None:
        fig, ax = plt.subplots(figsize=(4, 4))
    else:
        fig = ax.figure
    meas, pred = [], []
    for tr in traces:
        for step, seconds in step_intervals(tr):
            meas.append(seconds * 1e3)
            pred.append(cost_model.predict(step.scheduled) * 1e3)
    ax.scatter(meas, pred, s=6, alpha=0.5)
    hi = max(meas + pred)
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title("simulator cost model", fontsize=9)
    fig.tight_layout()
    return fig


# -- the matmul library under the linear layers ---------------------------------------------
@torch.inference_mode()
def linear_benchmark(model, rows: Sequence[int] = (1, 32, 512), repeats: int = 3) -> list[dict]:
    """Seconds for every decoder linear layer of ``model`` (not the vocabulary projection)
    to multiply ``n`` rows, once through ``nn.Linear`` as it is and once through oneDNN
    (``minivllm.linear``), best of ``repeats``. The layers run one after another as in a
    forward pass, so each weight comes from memory rather than cache, as in a real step.
    Whether ``linear_backend="auto"`` pays off on a given CPU is this ratio."""
    from minivllm.linear import onednn_linear, plain_linears

    output = model.get_output_embeddings()
    linears = [m for m in plain_linears(model) if m is not output]
    dtype = next(model.parameters()).dtype
    results = []

    def best(inputs: dict[int, torch.Tensor], swapped: list) -> float:
        times = []
        for _ in range(repeats):
            with onednn_linear(swapped):
                t = time.perf_counter()
                for m in linears:
                    m(inputs[m.in_features])
                times.append(time.perf_counter() - t)
        return min(times)

    for n in rows:
        inputs = {m.in_features: torch.randn(n, m.in_features, dtype=dtype) for m in linears}
        torch_s, onednn_s = best(inputs, []), best(inputs, linears)
        results.append({"rows": n, "layers": len(linears), "torch s": torch_s, "onednn s": onednn_s,
                        "speed-up": torch_s / onednn_s})
    return results


# -- command line --------------------------------------------------------------------------
def prefix_caching_benchmark(workload: Sequence[WorkloadRequest], model, tokenizer,
                             engine_kwargs: dict | None = None) -> list[dict]:
    """The same workload with prefix caching on and off, on one loaded model.

    Returns one row per setting: prompt tokens actually computed (prefill work in the
    trace), prefix-cache hit rate, mean TTFT, output tokens/s, and whether the greedy
    outputs equal the first setting's.
    """
    rows, first = [], None
    for caching in (True, False):
        cfg = EngineConfig(log_stats_interval=None, enable_prefix_caching=caching, **(engine_kwargs or {}))
        engine = LLMEngine(cfg, model, tokenizer)
        res = run_minivllm(engine, workload)
        ttfts = [m.ttft for m in engine.trace.requests.values() if m.ttft is not None]
        first = first or res.token_ids
        rows.append({
            "prefix caching": "on" if caching else "off",
            "prompt tokens": sum(r.num_prompt_tokens for r in workload),
            "prompt tokens computed": sum(s.num_prefill_tokens for s in engine.trace.steps),
            "hit rate": engine.kv_cache_manager.prefix_cache_stats.hit_rate,
            "mean TTFT s": sum(ttfts) / len(ttfts),
            "out tok/s": res.tokens_per_s,
            "wall s": res.wall_s,
            "same outputs": res.token_ids == first,
        })
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``minivllm bench`` options (shared by ``python -m minivllm.bench``)."""
    parser.add_argument("mode", choices=["throughput", "latency", "memory", "prefix", "linear", "fit-simulator",
                                         "simulate"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests in the workload (default 32; simulate: 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    parser.add_argument("--rates", default="0.25,0.5,1,2", help="latency: request rates (req/s)")
    parser.add_argument("--simulated", action="store_true", help="latency: use the simulator, not the model")
    parser.add_argument("--no-chunked-prefill-check", action="store_true",
                        help="latency: skip the long-prompt-among-decodes comparison")
    parser.add_argument("--max-model-len", type=int, default=2048, help="memory: contiguous reservation")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rate", type=float, default=None, help="simulate: Poisson rate (default: all at once)")
    parser.add_argument("--figures", default=str(FIGURES), help="folder for the figures ('' for none)")
    parser.add_argument("--out", default=None, help="fit-simulator: where to write the cost model JSON")


def _save(fig, args: argparse.Namespace, name: str) -> None:
    if args.figures:
        path = Path(args.figures) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        print(f"figure: {path}")


def run(args: argparse.Namespace) -> int:
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    engine_kwargs = dict(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                         max_num_seqs=args.max_num_seqs)
    if args.mode == "throughput":
        n = args.num_requests or 32
        tok = load_tokenizer(args.model)
        workload = chat_workload(tok, n, args.seed)
        tools = [t.strip() for t in args.tools.split(",") if t.strip()]
        report = throughput_benchmark(workload, args.model, tok, tools, engine_kwargs=engine_kwargs)
        w = report.workload
        print(f"workload: chat_workload(n={n}, seed={args.seed}): prompts {w['min_prompt']}-{w['max_prompt']} "
              f"tokens ({w['prompt_tokens']} in all), outputs {w['min_output']}-{w['max_output']} "
              f"({w['output_tokens']} in all), greedy, ignore_eos; torch threads "
              f"{report.environment['torch_threads']}")
        print(report.table())
        for tool, diffs in report.first_mismatch.items():
            if diffs:
                print(f"{tool}: {len(diffs)} requests differ from minivllm; first differing positions: {diffs}")
        _save(plot_throughput(report), args, "bench_throughput.png")
    elif args.mode == "latency":
        rates = [float(r) for r in args.rates.split(",")]
        n = args.num_requests or 16
        if args.simulated:
            from minivllm.simulator import make_simulated_engine

            from_model = load_tokenizer(args.model)

            def make(**kw):
                return make_simulated_engine(**{**engine_kwargs, **kw})
        else:
            engine0 = LLMEngine(EngineConfig(model=args.model, log_stats_interval=None, **engine_kwargs))
            from_model = engine0.tokenizer

            def make(**kw):
                # one loaded model, a fresh engine (empty cache, empty trace) per run
                cfg = EngineConfig(model=args.model, log_stats_interval=None, **{**engine_kwargs, **kw})
                return LLMEngine(cfg, engine0.model, engine0.tokenizer)
        points = latency_benchmark(make, rates, from_model, n=n, seed=args.seed)
        print(f"{n} chat requests per rate ({'simulated' if args.simulated else 'real engine, wall clock'}):")
        print(format_latency_table(points))
        _save(plot_latency(points), args, "bench_latency.png")
        if not args.no_chunked_prefill_check:
            cp = chunked_prefill_benchmark(make, tokenizer=from_model)
            for r in cp:
                print(f"{r.label}: decode ITL median {r.median_itl * 1e3:.0f} ms, max {r.max_itl * 1e3:.0f} ms; "
                      f"long prompt TTFT {r.long_ttft:.2f} s")
            _save(plot_chunked_prefill(cp), args, "bench_chunked_prefill.png")
    elif args.mode == "memory":
        tok = load_tokenizer(args.model)
        workload = chat_workload(tok, args.num_requests or 32, args.seed)
        m = kv_memory_report(workload, args.block_size, args.max_model_len)
        print(format_memory_report(m))
        _save(plot_memory(m), args, "bench_memory.png")
    elif args.mode == "prefix":
        from minivllm.model_loader import load_model

        model, tok = load_model(args.model)
        n = args.num_requests or 32
        workload = chat_workload(tok, n, args.seed, prompt_len=(270, 330), output_len=(16, 64),
                                 shared_prefix_len=256)
        rows = prefix_caching_benchmark(workload, model, tok, engine_kwargs)
        print(f"{n} chat requests sharing a 256-token system prompt (prompts 270-330 tokens, outputs 16-64):")
        for row in rows:
            print(", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    elif args.mode == "linear":
        from minivllm.linear import onednn_available
        from minivllm.model_loader import load_model

        if not onednn_available():
            print("this PyTorch build has no oneDNN: linear_backend='auto' keeps nn.Linear")
            return 1
        model, _ = load_model(args.model)
        print("every decoder linear layer once, weights from memory (best of 3):")
        for r in linear_benchmark(model):
            print(f"{r['rows']:>4} rows x {r['layers']} layers: nn.Linear {r['torch s'] * 1e3:7.1f} ms, "
                  f"oneDNN {r['onednn s'] * 1e3:7.1f} ms, {r['speed-up']:.2f}x")
    elif args.mode == "fit-simulator":
        out = args.out or str(Path(__file__).parent / "data" / "cost_model_smollm2_cpu.json")
        res = fit_simulator(args.model, n=args.num_requests or 32, out_path=out,
                            command=command or "python -m minivllm.bench fit-simulator")
        cm = res["cost_model"]
        print("coefficients (s):", {k: f"{v:.3e}" for k, v in cm.coefficients.items()})
        print("fit:", cm.meta["fit"])
        print("held out:", cm.meta["held_out"])
        print(f"saved {out}")
        _save(plot_cost_model_fit(cm, res["traces"]), args, "simulator_fit.png")
    elif args.mode == "simulate":
        from minivllm.simulator import simulate
        from minivllm.workload import iter_workload

        n = args.num_requests or 10000
        tok = load_tokenizer(args.model)
        res = simulate(iter_workload(tok, n, args.seed, rate=args.rate), **engine_kwargs)
        print(format_simulation(res))
    return 0


def format_simulation(res) -> str:
    rss = res.rss_samples
    grow = ""
    if len(rss) >= 2:
        grow = (f"; RSS {rss[0][1] / 2**20:.0f} MiB after {rss[0][0]} requests, "
                f"{rss[-1][1] / 2**20:.0f} MiB after {rss[-1][0]}")
    return (f"{res.num_finished}/{res.num_requests} requests finished in {res.wall_seconds:.1f} s of wall time "
            f"({res.num_steps} steps, {res.simulated_seconds:.0f} simulated s, {res.throughput:.0f} tok/s "
            f"simulated, {res.num_preemptions} preemptions); free blocks after: {res.free_blocks_after}/"
            f"{res.num_blocks}{grow}; TTFT p50 {_pct(res.ttft, 50):.2f} s, p99 {_pct(res.ttft, 99):.2f} s")


def load_tokenizer(model: str = "smollm2-135m-instruct"):
    """The tokenizer alone (no weights loaded), for building workloads."""
    from transformers import AutoTokenizer

    from minivllm.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
