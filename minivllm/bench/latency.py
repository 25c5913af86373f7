"""Latency mode: what users wait for as the request rate rises, and what chunked prefill buys.

``minivllm bench latency`` (notebooks 06 and 09) runs two experiments:

- :func:`latency_benchmark`: Poisson arrivals at several request rates, served by the
  real engine on the wall clock (or the simulator on its virtual clock); TTFT, ITL and
  end-to-end p50/p99 and throughput against the rate.
- :func:`chunked_prefill_benchmark`: the inter-token-latency spike one long prompt
  causes among running decodes, with chunked prefill off and on.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from minivllm.bench.common import engine_settings, load_tokenizer, save_figure
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.metrics import percentile
from minivllm.outputs import RequestOutput
from minivllm.sim.replay import replay_workload
from minivllm.sim.simulator import make_simulated_engine
from minivllm.sim.workload import WorkloadRequest, make_workload


# -- latency against request rate ---------------------------------------------------------
@dataclass
class LatencyPoint:
    rate: float
    num_requests: int
    duration_s: float
    """The replay's start (the clock's zero, before the first arrival) to the last finish:
    with few requests, the ramp-up and drain weigh on the throughput."""
    throughput: float
    """Output tokens per second over that span."""
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    e2e_p99: float
    simulated: bool = False
    time_source: str | None = None
    """Where a simulated point's times came from (``Trace.time_source``)."""


def latency_point(outputs: Iterable[RequestOutput], rate: float, start: float, end: float,
                  simulated: bool = False, time_source: str | None = None) -> LatencyPoint:
    """Summarise the final outputs of one run at one request rate."""
    outs = list(outputs)
    ttft = [o.metrics.ttft for o in outs]
    e2e = [o.metrics.e2e_latency for o in outs]
    itl = [x for o in outs for x in o.metrics.itls]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    span = end - start
    return LatencyPoint(rate, len(outs), span, tokens / span if span else 0.0,
                        percentile(ttft, 50), percentile(ttft, 99), percentile(itl, 50),
                        percentile(itl, 99), percentile(e2e, 50), percentile(e2e, 99), simulated,
                        time_source)


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
    clock, see :func:`minivllm.sim.simulator.make_simulated_engine`)."""
    points = []
    for rate in rates:
        engine = make_engine()
        workload = make_workload(tokenizer, n, seed, rate=rate, **workload_kwargs)
        res = replay_workload(engine, workload)
        simulated = hasattr(engine.clock, "advance")
        points.append(latency_point(res.outputs.values(), rate, res.start, res.end, simulated,
                                    engine.trace.time_source))
    return points


def format_latency_table(points: Sequence[LatencyPoint]) -> str:
    lines = [f"{'rate req/s':>10} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
             f"{'ITL p99':>8} {'e2e p50':>8} {'e2e p99':>8}   (seconds)"]
    for p in points:
        lines.append(f"{p.rate:>10.2f} {p.throughput:>7.1f} {p.ttft_p50:>9.3f} {p.ttft_p99:>9.3f} "
                     f"{p.itl_p50:>8.3f} {p.itl_p99:>8.3f} {p.e2e_p50:>8.2f} {p.e2e_p99:>8.2f}")
    return "\n".join(lines)


def plot_latency_vs_rate(points: Sequence[LatencyPoint], axes=None):
    """TTFT, ITL and end-to-end p50/p99 and throughput against the request rate.
    (``viz.plot_latency`` draws one run's per-request latencies from its trace.)"""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 4, figsize=(12, 3.3), layout="constrained")
    else:
        fig = axes[0].figure
    rates = [p.rate for p in points]
    for ax, key, title in zip(axes, ("ttft", "itl", "e2e"), ("TTFT", "ITL", "end-to-end")):
        ax.plot(rates, [getattr(p, f"{key}_p50") for p in points], "o-", color="tab:blue", label="p50")
        ax.plot(rates, [getattr(p, f"{key}_p99") for p in points], "s--", color="tab:orange", label="p99")
        ax.set_title(f"{title} (s)", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
    axes[3].plot(rates, [p.throughput for p in points], "o-", color="tab:green", label="output tokens / s")
    axes[3].set_title("output tokens / s", fontsize=9)
    axes[3].set_xlabel("request rate (req/s)")
    sources = sorted({p.time_source for p in points if p.time_source})
    if sources:
        fig.suptitle("times: " + "; ".join(sources), fontsize=8, color="0.25")
    # One key for all four panels, under them: inside, the p99 lines climb into any corner.
    latency_key(fig)
    return fig


def latency_key(fig) -> None:
    """(Re)draw the key of :func:`plot_latency_vs_rate` under its panels, from what they
    hold now (a notebook may have added points), each label once."""
    for old in list(fig.legends):
        old.remove()
    handles = {}
    for ax in fig.axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    constrained = type(fig.get_layout_engine()).__name__ == "ConstrainedLayoutEngine"
    place = dict(loc="outside lower center") if constrained else dict(loc="upper center", bbox_to_anchor=(0.5, 0.0))
    fig.legend(handles.values(), handles.keys(), ncol=len(handles), fontsize=8, **place)


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
    time_source: str | None = None
    """Where simulated times came from (``Trace.time_source``); None: the wall clock."""

    @property
    def max_itl(self) -> float:
        return max(self.decode_itls)

    @property
    def median_itl(self) -> float:
        return float(np.median(self.decode_itls))


def _decode_then_long_prompt(engine: LLMEngine, short: Sequence[WorkloadRequest], long: WorkloadRequest,
                             inject_after_steps: int) -> dict[str, RequestOutput]:
    """The short requests start at once; ``long`` is added after ``inject_after_steps``
    steps. Returns every final output."""
    for r in short:
        engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, r.sampling_params())
    done: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == inject_after_steps:
            engine.add_request(long.request_id, {"prompt_token_ids": long.prompt_token_ids},
                               long.sampling_params())
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
    return done


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
    (the budget is raised to hold it and the decodes), and every decode waits for it;
    with chunking it is cut into ``chunk_budget``-token chunks that share steps with the
    decodes. ``make_engine(max_num_batched_tokens=..., enable_chunked_prefill=...)``
    builds each engine."""
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
        done = _decode_then_long_prompt(engine, short, long, inject_after_steps)
        itls, times = [], []
        for r in short:
            m = done[r.request_id].metrics
            itls.extend(m.itls)
            times.extend(t - t0 for t in m.token_times[1:])
        order = np.argsort(times)
        lm = done["long"].metrics
        out.append(ChunkedPrefillResult(label, budget, chunked, [itls[i] for i in order],
                                        [times[i] for i in order], lm.ttft, lm.arrival_time - t0,
                                        engine.trace.time_source))
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
    sources = sorted({r.time_source for r in results if r.time_source})
    if sources:
        ax.set_title("times: " + "; ".join(sources), fontsize=8, color="0.25")
    fig.tight_layout()
    return fig


# -- command line --------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    """``minivllm bench latency``: the rate sweep, then (unless switched off) chunked prefill."""
    rates = [float(r) for r in args.rates.split(",")]
    n = args.num_requests or 16
    settings = engine_settings(args)
    if args.simulated:
        tokenizer = load_tokenizer(args.model)

        def make(**kw):
            return make_simulated_engine(**{**settings, **kw})
    else:
        engine0 = LLMEngine(EngineConfig(model=args.model, log_stats_interval=None, **settings))
        tokenizer = engine0.tokenizer

        def make(**kw):
            # one loaded model, a fresh engine (empty cache, empty trace) per run
            cfg = EngineConfig(model=args.model, log_stats_interval=None, **{**settings, **kw})
            return LLMEngine(cfg, engine0.model, engine0.tokenizer)
    points = latency_benchmark(make, rates, tokenizer, n=n, seed=args.seed)
    print(f"{n} chat requests per rate ({'simulated' if args.simulated else 'real engine, wall clock'}):")
    print(format_latency_table(points))
    save_figure(plot_latency_vs_rate(points), args.figures, "bench_latency.png")
    if not args.no_chunked_prefill_check:
        results = chunked_prefill_benchmark(make, tokenizer=tokenizer)
        for r in results:
            print(f"{r.label}: decode ITL median {r.median_itl * 1e3:.0f} ms, max {r.max_itl * 1e3:.0f} ms; "
                  f"long prompt TTFT {r.long_ttft:.2f} s")
        save_figure(plot_chunked_prefill(results), args.figures, "bench_chunked_prefill.png")
    return 0
