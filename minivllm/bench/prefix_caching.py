"""Prefix-caching mode: the same workload with the prefix cache on and off.

``minivllm bench prefix`` (notebook 07): requests that share a long system prompt, so
every request after the first can find its first blocks already computed. The report
counts the prompt tokens the engine really computed, the hit rate and the mean time to
first token, and checks that the greedy outputs do not change.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from minivllm.bench.common import engine_settings
from minivllm.bench.timing import Timing, compare, rotated
from minivllm.bench.tools import run_minivllm
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim.workload import WorkloadRequest, chat_workload


def prefix_caching_benchmark(workload: Sequence[WorkloadRequest], model, tokenizer,
                             engine_kwargs: dict | None = None, rounds: int = 1) -> list[dict]:
    """The same workload with prefix caching on and off, on one loaded model, ``rounds``
    times each, interleaved (on, off, then off, on, ...: :mod:`minivllm.bench.timing`).

    Returns one row per setting: prompt tokens actually computed (prefill work in the
    trace), prefix-cache hit rate, whether the greedy outputs equal the first setting's
    (the same in every round: they are counts), and the wall-clock figures as
    :class:`~minivllm.bench.timing.Timing` over the rounds (mean TTFT, output tokens/s).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    settings = (True, False)
    counts: dict[bool, dict] = {}
    ttft: dict[bool, list[float]] = {c: [] for c in settings}
    rates: dict[bool, list[float]] = {c: [] for c in settings}
    first = None
    for r in range(rounds):
        for caching in rotated(settings, r):
            cfg = EngineConfig(log_stats_interval=None, enable_prefix_caching=caching, **(engine_kwargs or {}))
            engine = LLMEngine(cfg, model, tokenizer)
            res = run_minivllm(engine, workload)
            ttfts = [m.ttft for m in engine.trace.requests.values() if m.ttft is not None]
            first = first or res.token_ids
            ttft[caching].append(sum(ttfts) / len(ttfts))
            rates[caching].append(res.tokens_per_s)
            row = {
                "prompt tokens": sum(w.num_prompt_tokens for w in workload),
                "prompt tokens computed": sum(s.num_prefill_tokens for s in engine.trace.steps),
                "hit rate": engine.kv_cache_manager.prefix_cache_stats.hit_rate,
                "same outputs": res.token_ids == first,
            }
            if counts.setdefault(caching, row) != row:  # deterministic: every round the same
                raise RuntimeError(f"prefix caching {caching}: round {r} differs from round 0: {row}")
    rows = []
    for caching in settings:
        name = "on" if caching else "off"
        rows.append({"prefix caching": name, **counts[caching],
                     "mean TTFT": Timing(f"caching {name}", tuple(ttft[caching])),
                     "out tok/s": Timing(f"caching {name}", tuple(rates[caching]), "tok/s", higher_is_better=True)})
    return rows


def main(args: argparse.Namespace) -> int:
    """``minivllm bench prefix``: chat requests sharing a 256-token system prompt."""
    from minivllm.worker.model_loader import load_model

    model, tok = load_model(args.model)
    n = args.num_requests or 32
    workload = chat_workload(tok, n, args.seed, prompt_len=(270, 330), output_len=(16, 64),
                             shared_prefix_len=256)
    rows = prefix_caching_benchmark(workload, model, tok, engine_settings(args), rounds=args.rounds)
    print(f"{n} chat requests sharing a 256-token system prompt (prompts 270-330 tokens, outputs 16-64), "
          f"{args.rounds} interleaved round(s) each; times are the median (middle half):")
    for row in rows:
        print(", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    on, off = rows
    print("time to first token:", compare(on["mean TTFT"], off["mean TTFT"]).verdict)
    print("throughput:", compare(on["out tok/s"], off["out tok/s"]).verdict)
    return 0
