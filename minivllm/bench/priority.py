"""Priority mode: interactive chat requests while a batch job floods the queue.

``minivllm bench priority`` (``scheduling_policy``, :mod:`minivllm.core.scheduler`)
replays one workload twice on the same loaded model, offline, with arrival times
(:func:`minivllm.sim.replay.replay_workload`): once with ``scheduling_policy="fcfs"`` and
once with ``"priority"``.

* The batch job: long prompts with long outputs, all arriving at time 0 (an evaluation
  run, a document store being summarised), priority 1.
* The interactive traffic: short chat requests with short answers, arriving at a steady
  rate while the batch job runs, priority 0 (people waiting for a first token).

Under fcfs an interactive request queues behind every batch request that arrived before
it; under priority it is admitted at the next free seat. The table gives the interactive
requests' TTFT p50/p99 and the batch job's output tokens per second (what it pays), each
policy measured in the same process, so the ratio is the result, not the absolute times.
The traces that :func:`priority_benchmark` returns are what
``minivllm.viz.plot_priority_timeline`` draws (the benchmark itself draws nothing: viz
already imports bench, so the arrow points one way).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.metrics import percentile
from minivllm.sim.replay import replay_workload
from minivllm.sim.workload import WorkloadRequest, chat_workload
from minivllm.trace import Trace

INTERACTIVE, BATCH = "interactive", "batch"


def priority_workload(tokenizer, num_batch: int = 16, num_interactive: int = 12,
                      interactive_rate: float = 1.0, seed: int = 0,
                      batch_prompt_len: tuple[int, int] = (300, 500),
                      batch_output_len: tuple[int, int] = (48, 128),
                      interactive_prompt_len: tuple[int, int] = (20, 60),
                      interactive_output_len: tuple[int, int] = (8, 24)) -> list[WorkloadRequest]:
    """The batch job (ids ``batch-i``, priority 1, all at time 0) and the interactive
    stream (ids ``interactive-i``, priority 0, one every ``1 / interactive_rate`` seconds,
    the first one second after the flood), sorted by arrival. ``tokenizer`` None gives
    random token ids (tests on tiny models)."""
    if interactive_rate <= 0:
        raise ValueError(f"interactive_rate must be > 0 requests/s, got {interactive_rate}")
    batch = chat_workload(tokenizer, num_batch, seed, prompt_len=batch_prompt_len,
                          output_len=batch_output_len)
    chat = chat_workload(tokenizer, num_interactive, seed + 1, prompt_len=interactive_prompt_len,
                         output_len=interactive_output_len)
    out = [dataclasses.replace(r, request_id=f"{BATCH}-{i}", arrival_time=0.0, priority=1)
           for i, r in enumerate(batch)]
    out += [dataclasses.replace(r, request_id=f"{INTERACTIVE}-{i}",
                                arrival_time=1.0 + i / interactive_rate, priority=0)
            for i, r in enumerate(chat)]
    return sorted(out, key=lambda r: r.arrival_time)


def request_group(request_id: str) -> str:
    """"interactive" or "batch", from a request id of :func:`priority_workload`."""
    return request_id.split("-", 1)[0]


def summarize_run(trace: Trace, policy: str) -> dict:
    """One row of the table from a run's trace."""
    groups: dict[str, list] = {INTERACTIVE: [], BATCH: []}
    for rid, m in trace.requests.items():
        groups[request_group(rid)].append(m)
    chat, batch = groups[INTERACTIVE], groups[BATCH]
    ttft = [m.ttft for m in chat]
    start = min(m.arrival_time for m in batch)
    batch_tokens = sum(len(m.token_times) for m in batch)
    batch_span = max(m.finished_time for m in batch) - start
    return {
        "policy": policy,
        "interactive TTFT p50 s": percentile(ttft, 50),
        "interactive TTFT p99 s": percentile(ttft, 99),
        "interactive e2e p50 s": percentile([m.e2e_latency for m in chat], 50),
        "batch tok/s": batch_tokens / batch_span,
        "batch done s": batch_span,
        "preemptions": sum(m.num_preemptions for m in chat + batch),
        "interactive preempted": sum(m.num_preemptions for m in chat),
    }


def admitted_ahead(trace: Trace) -> dict[str, list[str]]:
    """For each interactive request, the batch requests admitted while it waited: first
    scheduled at a step that began after it had been added to the engine and before the
    step that first scheduled it. The scheduler decides this, not the clock: under
    "priority" the list is empty for every interactive request (the waiting queue is
    ordered by priority, and admission stops at its head, never skips it); under "fcfs" it
    holds every batch request still waiting when the interactive one arrived. How many
    those are depends on how far the batch job got by then, on this machine.

    A request counts as added at step ``j`` once step ``j - 1`` ended after its arrival
    time (:func:`~minivllm.sim.replay.replay_workload` adds every request whose arrival time
    has passed before it steps), so a step that merely began after the arrival time, the
    request not yet added, is never counted against the scheduler."""
    steps = list(trace.steps)  # the whole run: a trace cut to its last steps would miss admissions
    first: dict[str, int] = {}
    for rec in steps:
        for chunk in rec.scheduled:
            first.setdefault(chunk.request_id, rec.step)
    out: dict[str, list[str]] = {}
    for rid, m in trace.requests.items():
        if request_group(rid) != INTERACTIVE:
            continue
        added = next((rec.step for prev, rec in zip(steps, steps[1:]) if prev.end >= m.arrival_time),
                     first[rid])
        out[rid] = sorted((b for b, j in first.items() if request_group(b) == BATCH and added <= j < first[rid]),
                          key=lambda b: (first[b], b))
    return out


def priority_benchmark(workload: Sequence[WorkloadRequest], model, tokenizer,
                       policies: Sequence[str] = ("fcfs", "priority"),
                       engine_kwargs: dict | None = None) -> tuple[list[dict], dict[str, Trace]]:
    """Replay ``workload`` once per policy on a fresh engine over the same ``model``
    (under fcfs every priority is 0: the engine refuses others, as vLLM does). Returns
    one row per policy and each run's trace. The greedy tokens must not depend on the
    policy: the last column says whether they equal the first run's."""
    rows, traces, first = [], {}, None
    for policy in policies:
        cfg = EngineConfig(log_stats_interval=None, scheduling_policy=policy, **(engine_kwargs or {}))
        engine = LLMEngine(cfg, model, tokenizer)
        requests = [r if policy == "priority" else dataclasses.replace(r, priority=0) for r in workload]
        res = replay_workload(engine, requests)
        tokens = {rid: out.outputs[0].token_ids for rid, out in res.outputs.items()}
        first = first or tokens
        rows.append({**summarize_run(engine.trace, policy), "same tokens": tokens == first})
        traces[policy] = engine.trace
    return rows, traces


def format_priority_table(rows: Sequence[dict]) -> str:
    keys = list(rows[0])
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    for row in rows:
        lines.append(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``minivllm bench priority``: the same flood plus chat stream under fcfs and priority."""
    import time

    from minivllm.bench.common import engine_settings
    from minivllm.worker.model_loader import load_model

    t = time.perf_counter()
    model, tok = load_model(args.model)
    workload = priority_workload(tok, num_batch=args.num_requests or 16,
                                 num_interactive=args.num_interactive,
                                 interactive_rate=args.interactive_rate, seed=args.seed)
    # Warm up once (first-call costs: the linear plan, allocator), outside the table.
    warm = LLMEngine(EngineConfig(log_stats_interval=None, **engine_settings(args)), model, tok)
    replay_workload(warm, [dataclasses.replace(r, priority=0) for r in workload[:2]])
    rows, traces = priority_benchmark(workload, model, tok, engine_kwargs=engine_settings(args))
    print(f"{len(workload)} requests: {sum(request_group(r.request_id) == BATCH for r in workload)} batch "
          f"at t=0, {args.num_interactive} interactive at {args.interactive_rate} req/s")
    print(format_priority_table(rows))
    fcfs, prio = rows[0], rows[-1]
    print(f"interactive TTFT p50: {fcfs['interactive TTFT p50 s'] / prio['interactive TTFT p50 s']:.1f}x "
          f"lower with priority; batch tok/s: {prio['batch tok/s'] / fcfs['batch tok/s']:.2f}x of fcfs")
    print(f"wall time, model load included: {time.perf_counter() - t:.0f} s")
    return 0 if all(r["same tokens"] for r in rows) else 1
