"""Speculative mode: n-gram drafts against none, on copying and on chat requests.

``minivllm bench speculative`` (notebook 12 when it exists; ``minivllm.spec_decode``)
serves two workloads with ``num_speculative_tokens`` k in {0, 2, 4, 8}, at batch 1 (one
request at a time: ``max_num_seqs=1``) and with 32 requests at once:

* copy: "repeat this text" over standard-library documentation, where most drafts are
  right (``minivllm.sim.workload.copy_workload``);
* chat: the standard chat workload (summarize, explain...), where few are.

Besides fixed k, two rows let the engine turn speculation down by itself under load:
"4 (off above 4)" is k = 4 with vLLM V0's ``"disable_by_batch_size": 4`` (no drafts while more
than 4 requests run; gone from vLLM since V0), and "auto" chooses up to 8 drafts each step, the length it measured
to give the most tokens per second at that batch size (``"adaptive": True``).

Each row: output tokens per second, mean end-to-end latency, acceptance rate, mean
acceptance length, and whether the greedy tokens equal k = 0's (they must). Speed is a
ratio against k = 0 measured in the same process, on the same loaded model.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from minivllm.bench.tools import run_minivllm
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim.workload import WorkloadRequest, chat_workload, copy_workload


def ngram(k: int, **extra) -> dict:
    """The n-gram ``speculative_config`` every row uses, with ``k`` drafts."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1, **extra}


SETTINGS: dict[int | str, dict | None] = {
    0: None,
    2: ngram(2),
    4: ngram(4),
    8: ngram(8),
    "4 (off above 4)": ngram(4, disable_by_batch_size=4),
    "auto": ngram(8, adaptive=True),
}
"""The rows compared, by label: no speculation (0, the baseline), fixed k, k = 4 turned off
while more than 4 requests run (vLLM's rule), and "auto", the engine's own choice each step
of up to 8 drafts (``minivllm.spec_decode.draft_length``)."""
KS = tuple(SETTINGS)


def speculative_benchmark(workload: Sequence[WorkloadRequest], model, tokenizer,
                          ks: Sequence[int | str] = KS, max_num_seqs: int = 32,
                          engine_kwargs: dict | None = None) -> list[dict]:
    """One row per label of :data:`SETTINGS` in ``ks`` (k = 0: no speculation, the
    baseline every other row is compared with). ``max_num_seqs`` 1 serves the requests one
    at a time."""
    unknown = [k for k in ks if k not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    rows, base = [], None
    for k in ks:
        spec = SETTINGS[k]
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
    from minivllm.worker.model_loader import load_model

    ks = [int(k) if k.strip().isdigit() else k.strip() for k in args.spec_rows.split(",") if k.strip()]
    unknown = [k for k in ks if k not in SETTINGS]
    if unknown:
        raise SystemExit(f"--spec-rows: unknown {unknown}; choose from {list(SETTINGS)}")
    ks = [0] + [k for k in ks if k != 0]  # the baseline always, first: every ratio is against it
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
            rows = speculative_benchmark(requests, model, tok, ks, batch, kwargs)
            print(f"{name} workload, {len(requests)} requests, batch {batch}:")
            for row in rows:
                print("  " + ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
                                       for k, v in row.items()))
            ok &= all(r["same tokens as k=0"] for r in rows)
    return 0 if ok else 1
