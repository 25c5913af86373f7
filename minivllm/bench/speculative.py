"""Speculative mode: n-gram drafts against none, on copying and on chat requests.

``minivllm bench speculative`` (notebook 12 when it exists; ``minivllm.spec_decode``)
serves two workloads with ``num_speculative_tokens`` k in {0, 2, 4, 8}, at batch 1 (one
request at a time: ``max_num_seqs=1``) and with 32 requests at once:

* copy: "repeat this text" over standard-library documentation, where most drafts are
  right (``minivllm.workload.copy_workload``);
* chat: the standard chat workload (summarize, explain...), where few are.

Besides fixed k, an "auto" row lets the engine choose up to 8 drafts each step, the
length it measured to give the most tokens per second at that batch size
(``"adaptive": True``).

Each row: output tokens per second, mean end-to-end latency, acceptance rate, mean
acceptance length, and whether the greedy tokens equal k = 0's (they must). Speed is a
ratio against k = 0 measured in the same process, on the same loaded model.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from minivllm.bench.tools import run_minivllm
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.workload import WorkloadRequest, chat_workload, copy_workload

KS = (0, 2, 4, 8, "auto")
"""Draft lengths compared: fixed k (``"adaptive": False``), and "auto", the engine's own
choice each step of up to 8 drafts (``minivllm.spec_decode.draft_length``)."""


def speculative_benchmark(workload: Sequence[WorkloadRequest], model, tokenizer,
                          ks: Sequence[int | str] = KS, max_num_seqs: int = 32,
                          engine_kwargs: dict | None = None) -> list[dict]:
    """One row per k (k = 0: no speculation, the baseline every other row is compared
    with; "auto": the engine chooses up to 8 per step). ``max_num_seqs`` 1 serves the
    requests one at a time."""
    rows, base = [], None
    for k in ks:
        spec = {"method": "ngram", "num_speculative_tokens": 8 if k == "auto" else k,
                "prompt_lookup_max": 4, "prompt_lookup_min": 1, "adaptive": k == "auto"} if k else None
        cfg = EngineConfig(log_stats_interval=None, max_num_seqs=max_num_seqs, speculative_config=spec,
                           **(engine_kwargs or {}))
        engine = LLMEngine(cfg, model, tokenizer)
        res = run_minivllm(engine, workload)
        e2e = [m.e2e_latency for m in engine.trace.requests.values()]
        sd = engine.stats.spec_decoding
        base = base or res
        rows.append({
            "k": k,
            "batch": max_num_seqs,
            "out tok/s": res.tokens_per_s,
            "speedup": res.tokens_per_s / base.tokens_per_s,
            "mean latency s": sum(e2e) / len(e2e),
            "acceptance rate": sd.acceptance_rate if sd else float("nan"),
            "mean acceptance length": sd.mean_acceptance_length if sd else 1.0,
            "steps": len(engine.trace.steps),
            "same tokens as k=0": res.token_ids == base.token_ids,
        })
    return rows


def main(args: argparse.Namespace) -> int:
    """``minivllm bench speculative``: copy and chat workloads, batch 1 and 32 at once."""
    from minivllm.model_loader import load_model

    model, tok = load_model(args.model)
    n = args.num_requests or 32
    n1 = max(1, n // 8)  # batch 1 is served one request at a time: fewer requests
    makers = {"copy": copy_workload, "chat": chat_workload}
    names = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(names) - set(makers))
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; choose from {sorted(makers)}")
    workloads = {w: makers[w](tok, n, args.seed) for w in names}
    kwargs = {"block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens}
    ok = True
    for name, workload in workloads.items():
        for batch, requests in ((1, workload[:n1]), (n, workload)):
            rows = speculative_benchmark(requests, model, tok, KS, batch, kwargs)
            print(f"{name} workload, {len(requests)} requests, batch {batch}:")
            for row in rows:
                print("  " + ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
                                       for k, v in row.items()))
            ok &= all(r["same tokens as k=0"] for r in rows)
    return 0 if ok else 1
