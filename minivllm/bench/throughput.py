"""Throughput mode: one offline workload, every request at once, served by every tool.

``minivllm bench throughput`` (notebooks 02 and 09). The tools are in
:mod:`minivllm.bench.tools`; minivllm is the reference for the greedy-identity check, so
the report says both how fast each tool is and whether it produced exactly minivllm's
tokens. With ``rounds`` > 1 every tool serves the workload once per round, interleaved
(the order rotates each round, as :func:`minivllm.bench.timing.measure` does), and the
report gives each tool's median with the middle half of its rounds
(:attr:`ThroughputReport.timings`), so a verdict from :func:`minivllm.bench.timing.compare`
can say whether a difference is clear on this machine. It also counts the forward passes
each tool made (engine steps for minivllm, calls of the model's ``forward`` for the
transformers baselines): that count does not depend on the clock. And it reports the
engine's overhead: the share of step time spent outside the model forward, read off the trace.
"""

from __future__ import annotations

import argparse
import copy
import logging
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from minivllm.bench.common import engine_settings, load_tokenizer, save_figure
from minivllm.bench.timing import Timing, compare, rotated
from minivllm.bench.tools import (
    TOOL_LABELS,
    TOOLS,
    VARIANTS,
    ToolResult,
    run_hf_continuous,
    run_hf_generate,
    run_hf_static,
    run_minivllm,
)
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim.workload import WorkloadRequest, chat_workload, make_workload, summarize
from minivllm.trace import Trace
from minivllm.worker.model_loader import DEFAULT_MODEL

logger = logging.getLogger("minivllm")

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
    wall_s: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Per tool: the wall time of every round, in the order they ran."""
    forward_passes: dict[str, int] = field(default_factory=dict)
    """Per tool: forward passes through the model in one round (engine steps for
    minivllm; calls of the model's ``forward`` for the transformers tools)."""

    def result(self, tool: str) -> ToolResult | None:
        return next((r for r in self.results if r.tool == tool), None)

    @property
    def rounds(self) -> int:
        return min((len(w) for w in self.wall_s.values()), default=1)

    @property
    def timings(self) -> dict[str, Timing]:
        """Per tool: output tokens per second of each round, named by the tool's label,
        for :func:`minivllm.bench.timing.table` and :func:`~minivllm.bench.timing.compare`."""
        out = {}
        for r in self.results:
            walls = self.wall_s.get(r.tool, (r.wall_s,))
            out[r.tool] = Timing(TOOL_LABELS.get(r.tool, r.tool), tuple(walls)).rate(r.output_tokens, "tok/s")
        return out

    def table(self) -> str:
        base = self.result("hf-generate")
        timings = self.timings
        n = self.workload["num_requests"]
        lines = [f"{'tool':<46} {'wall s':>6} {'out tok/s':>9} {'middle half':>13} {'vs 1-at-a-time':>14} "
                 f"{'passes':>6} {'same as minivllm':>16}"]
        for r in self.results:
            t = timings[r.tool]
            ratio = f"{t.median / timings['hf-generate'].median:.2f}x" if base else "-"
            same = f"{self.matches.get(r.tool, n)}/{n}"
            passes = self.forward_passes.get(r.tool)
            spread = f"{t.low:.1f}-{t.high:.1f}"
            lines.append(f"{TOOL_LABELS.get(r.tool, r.tool):<46} {r.wall_s:>6.2f} {t.median:>9.1f} {spread:>13} "
                         f"{ratio:>14} {passes if passes is not None else '-':>6} {same:>16}")
        lines.append(f"(medians of {self.rounds} interleaved round{'s' if self.rounds > 1 else ''}; middle half: "
                     "the 25th to 75th percentile of the rounds)")
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


def _compare_tokens(workload: Sequence[WorkloadRequest], results: list[ToolResult]):
    """Per tool after the first: how many requests match the first's tokens, and where
    the others first differ."""
    ref = results[0].token_ids
    matches, mismatches = {}, {}
    for r in results[1:]:
        diffs = [(w.request_id, _first_diff(a, b)) for w, a, b in zip(workload, ref, r.token_ids)]
        diffs = [(rid, i) for rid, i in diffs if i >= 0]
        matches[r.tool] = len(workload) - len(diffs)
        mismatches[r.tool] = diffs
    return matches, mismatches


def _engine_and_baseline(model: str | torch.nn.Module, tokenizer, kwargs: dict, tools: Sequence[str]):
    """The engine, the transformers model the baselines run (None when none runs), and
    the tokenizer. A loaded model is copied for the baselines, as the engine installs its
    own attention function on the one it gets."""
    from minivllm.worker.model_loader import load_model

    if isinstance(model, str):
        engine = LLMEngine(EngineConfig(model=model, **kwargs))
        baseline = load_model(model)[0] if any(t.startswith("hf-") for t in tools) else None
        return engine, baseline, tokenizer or engine.tokenizer
    baseline = copy.deepcopy(model)
    return LLMEngine(EngineConfig(**kwargs), model, tokenizer), baseline, tokenizer


def _environment(engine: LLMEngine) -> dict:
    return {
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


def throughput_benchmark(
    workload: Sequence[WorkloadRequest],
    model: str | torch.nn.Module = DEFAULT_MODEL,
    tokenizer=None,
    tools: Sequence[str] = TOOLS,
    static_batch_size: int = 8,
    engine_kwargs: dict | None = None,
    min_running: int = 32,
    rounds: int = 1,
) -> ThroughputReport:
    """Serve ``workload`` with each tool in ``tools`` (minivllm always runs: it is the
    reference for the greedy-identity check) and compare. ``model`` is an embedded model
    name or a loaded transformers model.

    Every tool first serves a tiny warm-up workload (not timed), then the workload once
    per round for ``rounds`` rounds, interleaved: round r runs the tools in their order
    rotated by r (:func:`~minivllm.bench.timing.rotated`), so a slow minute of a shared machine slows all of them alike. Each
    result's ``wall_s`` is the median over the rounds; ``report.wall_s`` keeps every round
    and ``report.timings`` gives tokens/s with their spread. Greedy tokens are compared on
    the first round (every round serves the same ids)."""
    unknown = set(tools) - set(TOOLS)
    if unknown:
        raise ValueError(f"unknown tools {sorted(unknown)}; choose from {TOOLS}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    workload = list(workload)
    kwargs = {"log_stats_interval": None, **(engine_kwargs or {})}
    engine, baseline, tokenizer = _engine_and_baseline(model, tokenizer, kwargs, tools)
    pad = 0
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runner = _ToolRunner(engine, baseline, tokenizer, kwargs, workload, pad, static_batch_size)
    names = ["minivllm"] + [t for t in tools if t != "minivllm"]
    first: dict[str, ToolResult] = {}
    walls: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for tool in rotated(names, r):
            res = runner.run(tool)
            first.setdefault(tool, res)
            walls[tool].append(res.wall_s)
            logger.info("%s, round %d: %.1f s", tool, r + 1, res.wall_s)
    if runner.hook is not None:
        runner.hook.remove()
    results = [replace(first[n], wall_s=float(np.median(walls[n]))) for n in names]
    matches, mismatches = _compare_tokens(workload, results)
    overhead = {**engine_overhead(engine.trace, min_running), "min_running": min_running}
    passes = runner.passes
    return ThroughputReport(summarize(workload), results, matches, mismatches, overhead, _environment(engine),
                            {n: tuple(walls[n]) for n in names}, {n: passes[n] for n in names if n in passes})


class _ToolRunner:
    """Serves the workload with one tool of :func:`throughput_benchmark` at a time, and
    counts the forward passes each made (``passes``: the engine's steps for minivllm's
    rows, the model's calls for transformers'), the mechanism behind a speed-up that a
    wall clock on a shared machine only hints at. Made once per benchmark: it first runs
    a short warm-up of each path, outside the timings (first calls allocate and compile)."""

    def __init__(self, engine: LLMEngine, baseline: torch.nn.Module | None, tokenizer, kwargs: dict,
                 workload: list[WorkloadRequest], pad: int, static_batch_size: int) -> None:
        self.engine, self.baseline, self.tokenizer, self.kwargs = engine, baseline, tokenizer, kwargs
        self.workload, self.pad, self.static_batch_size = workload, pad, static_batch_size
        self.passes: dict[str, int] = {}
        self.variant_engines: dict[str, LLMEngine] = {}
        self.calls = 0
        self.hook = None
        self.warm = make_workload(None, 2, seed=99, prompt_len=(8, 16), output_len=4, vocab_size=100)
        for w in self.warm:
            w.request_id = f"warmup-{w.request_id}"
        run_minivllm(engine, self.warm)
        if baseline is not None:
            baseline.set_attn_implementation("sdpa")
            run_hf_generate(baseline, self.warm[:1], pad)
            # Count the forward passes of the transformers tools: one call of the model per pass.
            self.hook = baseline.register_forward_pre_hook(self._count_call)

    def _count_call(self, module: torch.nn.Module, args: object) -> None:
        self.calls += 1

    def run(self, tool: str) -> ToolResult:
        """One serving of the whole workload by ``tool`` (one of :data:`TOOLS`)."""
        baseline, workload, pad = self.baseline, self.workload, self.pad
        hf_runs = {
            "hf-generate": lambda: run_hf_generate(baseline, workload, pad),
            "hf-static": lambda: run_hf_static(baseline, workload, self.static_batch_size, pad),
            "hf-cb": lambda: run_hf_continuous(
                baseline, workload, pad_token_id=pad, max_batch_tokens=self.engine.config.max_num_batched_tokens),
        }
        if tool in hf_runs:
            self.calls = 0
            res = hf_runs[tool]()
            self.passes[tool] = self.calls
            return res
        if tool == "minivllm":
            return self._reference()
        return self._variant(tool)

    def _reference(self) -> ToolResult:
        engine = self.engine
        engine.trace.clear()
        engine.reset_prefix_cache()
        res = run_minivllm(engine, self.workload)
        self.passes["minivllm"] = len(engine.trace.steps)
        return res

    def _variant(self, tool: str) -> ToolResult:
        # The same engine over the same model with one setting changed (VARIANTS). With
        # every linear layer through one library, whatever "auto" measured
        # (minivllm.worker.linear): "torch" is nn.Linear as is, so that row also shows how
        # much of minivllm's lead is scheduling and paging rather than the matmul. With
        # async scheduling: what overlapping the engine's Python with the model gains.
        if tool not in self.variant_engines:
            variant = LLMEngine(EngineConfig(**{**self.kwargs, **VARIANTS[tool]}), self.engine.model,
                                self.tokenizer)
            run_minivllm(variant, self.warm)
            self.variant_engines[tool] = variant
        variant = self.variant_engines[tool]
        variant.trace.clear()
        variant.reset_prefix_cache()  # an earlier round's prompts must not be found cached
        res = replace(run_minivllm(variant, self.workload), tool=tool)
        self.passes[tool] = len(variant.trace.steps)
        return res


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
    t = report.timings  # medians of the rounds (with one round: that round)
    val = [t[r.tool].median for r in res]
    xerr = None
    if report.rounds > 1:  # the middle half of the rounds around each median
        xerr = [[v - t[r.tool].low for v, r in zip(val, res)], [t[r.tool].high - v for v, r in zip(val, res)]]
    ax.barh(y, val, color=colors, xerr=xerr, capsize=3)
    ax.set_yticks(y, [TOOL_LABELS.get(r.tool, r.tool) for r in res], fontsize=8)
    for yi, v, r in zip(y, val, res):
        note = f" {v:.0f} tok/s"
        if base:
            note += f" ({v / t[base.tool].median:.1f}x)"
        ax.text(t[r.tool].high if xerr else v, yi, note, va="center", fontsize=8)
    ax.set_xlim(0, max(t[r.tool].high for r in res) * 1.35)
    w = report.workload
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title(f"{w['num_requests']} chat requests, {w['prompt_tokens']} prompt + "
                 f"{w['output_tokens']} output tokens, greedy", fontsize=9)
    fig.tight_layout()
    return fig


def main(args: argparse.Namespace) -> int:
    """``minivllm bench throughput``: the chat workload through every selected tool."""
    n = args.num_requests or 32
    tok = load_tokenizer(args.model)
    workload = chat_workload(tok, n, args.seed)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    report = throughput_benchmark(workload, args.model, tok, tools, engine_kwargs=engine_settings(args),
                                  rounds=args.rounds)
    w = report.workload
    print(f"workload: chat_workload(n={n}, seed={args.seed}): prompts {w['min_prompt']}-{w['max_prompt']} "
          f"tokens ({w['prompt_tokens']} in all), outputs {w['min_output']}-{w['max_output']} "
          f"({w['output_tokens']} in all), greedy, ignore_eos; torch threads "
          f"{report.environment['torch_threads']}; minivllm's linear_backend='auto' chose: "
          f"{report.environment['linear_backend']}")
    print(report.table())
    timings = report.timings
    for tool in timings:
        if tool != "minivllm":
            print(compare(timings["minivllm"], timings[tool]).verdict)
    for tool, diffs in report.first_mismatch.items():
        if diffs:
            print(f"{tool}: {len(diffs)} requests differ from minivllm; first differing positions: {diffs}")
    save_figure(plot_throughput(report), args.figures, "bench_throughput.png")
    return 0
