"""Throughput mode: one offline workload, every request at once, served by every tool.

``minivllm bench throughput`` (notebooks 02 and 09). The tools are in
:mod:`minivllm.bench.tools`; minivllm always runs first and is the reference for the
greedy-identity check, so the report says both how fast each tool is and whether it
produced exactly minivllm's tokens. It also reports the engine's overhead: the share of
step time spent outside the model forward, read off the trace.
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
from minivllm.bench.tools import (
    TOOL_LABELS,
    TOOLS,
    ToolResult,
    run_hf_continuous,
    run_hf_generate,
    run_hf_static,
    run_minivllm,
)
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.model_loader import DEFAULT_MODEL
from minivllm.trace import Trace
from minivllm.workload import WorkloadRequest, chat_workload, make_workload, summarize

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
    from minivllm.model_loader import load_model

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
) -> ThroughputReport:
    """Serve ``workload`` with each tool in ``tools`` (minivllm always runs: it is the
    reference for the greedy-identity check) and compare. ``model`` is an embedded model
    name or a loaded transformers model."""
    unknown = set(tools) - set(TOOLS)
    if unknown:
        raise ValueError(f"unknown tools {sorted(unknown)}; choose from {TOOLS}")
    workload = list(workload)
    kwargs = {"log_stats_interval": None, **(engine_kwargs or {})}
    engine, baseline, tokenizer = _engine_and_baseline(model, tokenizer, kwargs, tools)
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

    def fixed_linear(backend: str) -> ToolResult:
        # The same engine with every linear layer through one library, whatever "auto"
        # measured (minivllm.linear): "torch" is nn.Linear as is, so that row also shows
        # how much of minivllm's lead is scheduling and paging rather than the matmul.
        fixed = LLMEngine(EngineConfig(**{**kwargs, "linear_backend": backend}), engine.model, tokenizer)
        run_minivllm(fixed, warm)
        return replace(run_minivllm(fixed, workload), tool=f"minivllm-{backend}-linear")

    others = {
        "minivllm-torch-linear": lambda: fixed_linear("torch"),
        "minivllm-onednn-linear": lambda: fixed_linear("onednn"),
        "minivllm-transposed-linear": lambda: fixed_linear("transposed"),
        "hf-generate": lambda: run_hf_generate(baseline, workload, pad),
        "hf-static": lambda: run_hf_static(baseline, workload, static_batch_size, pad),
        "hf-cb": lambda: run_hf_continuous(baseline, workload, pad_token_id=pad,
                                           max_batch_tokens=engine.config.max_num_batched_tokens),
    }
    for tool in tools:
        if tool != "minivllm":
            results.append(others[tool]())
            logger.info("%s: %.1f s", tool, results[-1].wall_s)
    matches, mismatches = _compare_tokens(workload, results)
    overhead = {**engine_overhead(engine.trace, min_running), "min_running": min_running}
    return ThroughputReport(summarize(workload), results, matches, mismatches, overhead, _environment(engine))


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


def main(args: argparse.Namespace) -> int:
    """``minivllm bench throughput``: the chat workload through every selected tool."""
    n = args.num_requests or 32
    tok = load_tokenizer(args.model)
    workload = chat_workload(tok, n, args.seed)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    report = throughput_benchmark(workload, args.model, tok, tools, engine_kwargs=engine_settings(args))
    w = report.workload
    print(f"workload: chat_workload(n={n}, seed={args.seed}): prompts {w['min_prompt']}-{w['max_prompt']} "
          f"tokens ({w['prompt_tokens']} in all), outputs {w['min_output']}-{w['max_output']} "
          f"({w['output_tokens']} in all), greedy, ignore_eos; torch threads "
          f"{report.environment['torch_threads']}; minivllm's linear_backend='auto' chose: "
          f"{report.environment['linear_backend']}")
    print(report.table())
    for tool, diffs in report.first_mismatch.items():
        if diffs:
            print(f"{tool}: {len(diffs)} requests differ from minivllm; first differing positions: {diffs}")
    save_figure(plot_throughput(report), args.figures, "bench_throughput.png")
    return 0
