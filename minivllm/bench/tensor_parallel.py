"""Tensor-parallel mode: step time split into compute and communication, T = 1, 2, 3.

``minivllm bench tensor-parallel`` (notebook 14). The same greedy requests run with
``tensor_parallel_size`` T for each T asked (``--tp-sizes``), on the default model
(SmolLM2-135M: 9 query heads and 3 KV heads, so T=2 is refused and reported as such)
and on a tiny random model whose 6 heads divide 1, 2 and 3. For each T it reports the
forward pass of the decode steps and of the steps with prompt tokens, split into
compute and communication (rank 0's and the slowest worker's), the all-reduces per
step, the throughput, and whether the tokens are identical to T=1. Before those, one
all-reduce is timed alone (``measure_all_reduce``: T processes doing nothing else), the
transport's own cost; in a step an all-reduce costs more, because it also waits for the
slowest rank to arrive.

On one small CPU the ranks share the same cores and memory bandwidth, so splitting the
model saves no arithmetic time and adds an all-reduce per block: expect T > 1 to be
slower there, and read from the split by how much. Each row also keeps every step's
rank-0 compute and communication (``decode_compute_s``, ``decode_comm_s``, ...), so
that a lesson prints them with their spread (:mod:`minivllm.bench.timing`). On GPUs each
rank brings its own compute and memory bandwidth, and the all-reduce runs over NVLink;
that is where tensor parallelism pays.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.bench.common import load_tokenizer
from minivllm.distributed.parallel_state import measure_all_reduce
from minivllm.sampling_params import SamplingParams
from minivllm.utils.system_utils import available_cpus
from minivllm.worker.model_loader import DEFAULT_MODEL, make_tiny_model

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about paged memory.",
    "List three uses of a hash table.",
    "What is the capital of France, and why is it famous?",
    "Describe continuous batching to a new engineer.",
    "Give a short recipe for pancakes.",
    "Why do GPUs help neural networks?",
    "Summarise the plot of Hamlet in one paragraph.",
]


def run_one(model, tensor_parallel_size: int, prompts: list[list[int]], max_tokens: int,
            **engine) -> dict:
    """Generate greedily with ``tensor_parallel_size`` ranks; the timing of each step."""
    from minivllm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Rank 0 takes the same share of the cores as each worker (the executor gives them
    # cpu_count // T threads), as each GPU would be a device of its own.
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, available_cpus() // tensor_parallel_size))
    try:
        return _run_one(LLM, model, tensor_parallel_size, prompts, max_tokens, params, **engine)
    finally:
        torch.set_num_threads(saved_threads)


def _run_one(LLM, model, tensor_parallel_size: int, prompts: list[list[int]], max_tokens: int,
             params: SamplingParams, **engine) -> dict:
    t_start = time.perf_counter()
    with LLM(model, tensor_parallel_size=tensor_parallel_size, log_stats_interval=0, **engine) as llm:
        startup = time.perf_counter() - t_start
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
        llm.trace.clear()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = list(llm.trace.steps)
    row: dict = {"T": tensor_parallel_size, "threads_per_rank": torch.get_num_threads(), "startup_s": startup, "wall_s": wall,
                 "tokens": [o.outputs[0].token_ids for o in outs],
                 "output_tok_s": len(prompts) * max_tokens / wall}
    for kind, sel in (("decode", [s for s in steps if s.num_prefill_tokens == 0]),
                      ("prefill", [s for s in steps if s.num_prefill_tokens > 0])):
        if not sel:
            continue
        row[f"{kind}_steps"] = len(sel)
        row[f"{kind}_step_ms"] = 1e3 * statistics.mean(s.duration for s in sel)
        # Each step's rank-0 compute and communication (seconds), for a spread:
        # minivllm.bench.timing.Timing(name, row["decode_compute_s"]).
        if tensor_parallel_size == 1:
            row[f"{kind}_compute_s"] = tuple(s.model_time for s in sel)
            row[f"{kind}_comm_s"] = tuple(0.0 for _ in sel)
            row[f"{kind}_worker_comm_ms"] = 0.0
        else:
            row[f"{kind}_compute_s"] = tuple(s.parallel.compute_time[0] for s in sel)
            row[f"{kind}_comm_s"] = tuple(s.parallel.comm_time[0] for s in sel)
            row[f"{kind}_worker_comm_ms"] = 1e3 * statistics.mean(max(s.parallel.comm_time[1:])
                                                                  for s in sel)
            row["all_reduces_per_step"] = sel[0].parallel.num_all_reduces
        row[f"{kind}_compute_ms"] = 1e3 * statistics.mean(row[f"{kind}_compute_s"])
        row[f"{kind}_comm_ms"] = 1e3 * statistics.mean(row[f"{kind}_comm_s"])
    return row


def compare(label: str, model, sizes: list[int], prompts: list[list[int]], max_tokens: int,
            **engine) -> list[dict]:
    """:func:`run_one` for every T; a T the model refuses is reported, not run."""
    rows: list[dict] = []
    for t in sizes:
        try:
            row = run_one(model, t, prompts, max_tokens, **engine)
        except ValueError as e:
            rows.append({"T": t, "refused": str(e)})
            print(f"{label} T={t}: refused: {e}")
            continue
        base = next((r for r in rows if r["T"] == 1), None)
        row["identical_to_T1"] = None if base is None else row["tokens"] == base["tokens"]
        rows.append(row)
        threads = row["threads_per_rank"]
        same = "(reference)" if t == 1 else row["identical_to_T1"]
        print(f"{label} T={t} ({threads} thread{'s' * (threads != 1)} per rank): startup {row['startup_s']:.1f} s, "
              f"{row['output_tok_s']:.1f} output tok/s, identical to T=1: {same}")
        for kind in ("decode", "prefill"):
            if f"{kind}_steps" in row:
                fwd = row[f"{kind}_compute_ms"] + row[f"{kind}_comm_ms"]
                print(f"  {kind:7s} steps {row[f'{kind}_steps']:3d}: step {row[f'{kind}_step_ms']:7.1f} ms;"
                      f" rank-0 forward {fwd:7.1f} ms = compute {row[f'{kind}_compute_ms']:7.1f}"
                      f" + all-reduce {row[f'{kind}_comm_ms']:6.1f} ms"
                      f" ({row[f'{kind}_comm_ms'] / fwd:.0%}); slowest worker's all-reduce "
                      f"{row[f'{kind}_worker_comm_ms']:.1f} ms")
        if "all_reduces_per_step" in row:
            print(f"  all-reduces per step on each rank: {row['all_reduces_per_step']}")
    return rows


def main(args: argparse.Namespace) -> int:
    """``minivllm bench tensor-parallel``: step time split into compute and communication."""
    sizes = [int(t) for t in args.tp_sizes.split(",")]
    n = args.num_requests or 8
    max_tokens = args.tp_max_tokens
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                             add_generation_prompt=True, tokenize=True)
               for i in range(n)]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    engine = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  block_size=args.block_size, distributed_executor_backend=args.distributed_executor_backend)
    print(f"{n} requests, {max_tokens} greedy tokens each, tensor_parallel_size in {sizes}, "
          f"ranks started by {args.distributed_executor_backend!r}")
    compare(args.model, args.model, sizes, prompts, max_tokens, **engine)
    hidden = 576  # SmolLM2-135M's hidden size: a decode step all-reduces one row per request
    print("all-reduce alone (gloo over loopback, no model running), float32 values:")
    for t in sorted(set(sizes) - {1}):
        for rows in (1, n, 64):
            us = 1e6 * measure_all_reduce(t, rows * hidden)
            print(f"  T={t}: {rows:3d} x {hidden} values: {us:8.1f} us per all-reduce")
    if args.model == DEFAULT_MODEL:
        # 6 query heads and 6 KV heads divide 1, 2 and 3; SmolLM2-like widths, 8 layers.
        tiny = make_tiny_model("llama", vocab_size=tokenizer.vocab_size, hidden_size=576,
                               intermediate_size=1536, num_hidden_layers=8, num_attention_heads=6,
                               num_key_value_heads=6)
        compare("tiny llama (6 heads, 8 layers)", tiny, sorted(set(sizes) | {1, 2, 3}),
                prompts, max_tokens, **engine)
    return 0
