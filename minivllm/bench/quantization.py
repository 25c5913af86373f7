"""Quantization mode: what 8-bit weights and an 8-bit KV cache buy in speed and memory,
and what they cost in quality.

``minivllm bench quantization`` loads the model once and serves it in each setting of
``quantization`` and ``kv_cache_dtype`` (:data:`SETTINGS`: float32 weights and cache, the
baseline, first; then int8 weights, ``minivllm.worker.quantization``; an fp8 cache,
``minivllm.worker.kv_cache_quant``; and both), measuring every setting the same way in
the same process:

* **memory**: the bytes of the linear layers' weights (what a decode step reads), and the
  tokens whose keys and values fit in one GiB of KV cache (what a batch can hold);
* **speed**: batch-1 decode (one request at a time, output tokens per second after its
  first token) and 32 requests at once (output tokens per second over the run), in
  ``--rounds`` interleaved rounds so a disturbance hits every setting alike; the median
  and the range of the rounds;
* **perplexity** on text nobody here wrote: the Python standard library's docstrings
  (``minivllm.sim.workload.corpus_documents``), scored token by token with
  ``prompt_logprobs`` through the engine, so it measures the code that serves;
* **greedy agreement** with float32 on the same prompts: the share of requests whose
  greedy tokens are identical, and the mean number of tokens before the first difference;
* **answers**: short questions with one right answer (arithmetic, capitals), right when
  the answer appears in the reply.

The float32 row's greedy tokens are the baseline, so its agreement is 1.0 by construction
and is not a finding.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Sequence

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.sim.workload import chat_workload, corpus_documents
from minivllm.worker.model_runner import kv_cache_bytes_per_token

Setting = tuple[str | None, str]
"""(``quantization``, ``kv_cache_dtype``), as ``LLM`` takes them."""

SETTINGS: tuple[Setting, ...] = ((None, "auto"), ("int8", "auto"), (None, "fp8"), ("int8", "fp8"))
"""The rows: float32 weights and cache (the baseline) first."""

TASKS: tuple[tuple[str, str], ...] = (
    ("What is 7 times 8? Answer with the number only.", "56"),
    ("What is 12 plus 30? Answer with the number only.", "42"),
    ("What is 100 minus 1? Answer with the number only.", "99"),
    ("What is 9 times 9? Answer with the number only.", "81"),
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Egypt?", "Cairo"),
)
"""Questions with one right answer, and the text a right reply contains."""

AGREEMENT_PROMPTS = (
    "Explain why the sky is blue.",
    "Write a short poem about autumn.",
    "What is a linked list?",
    "Give three tips for learning a new language.",
    "Describe how a bicycle works.",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet.",
    "Why do we need sleep?",
)


def perplexity(llm: LLM, token_chunks: Sequence[list[int]]) -> float:
    """exp of the mean negative log-probability the model gives each token of the chunks
    after their first (scored in one pass per chunk, as prompts)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([{"prompt_token_ids": c} for c in token_chunks], params, use_tqdm=False)
    total, count = 0.0, 0
    for chunk, out in zip(token_chunks, outs, strict=True):
        for token, entry in zip(chunk[1:], out.prompt_logprobs[1:], strict=True):
            total -= entry[token].logprob
            count += 1
    return math.exp(total / count)


def text_chunks(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` chunks of ``length`` tokens of standard-library documentation."""
    ids: list[int] = []
    for doc in corpus_documents():
        ids += tokenizer.encode(doc + "\n\n", add_special_tokens=False)
        if len(ids) >= n * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def agreement(base: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of requests with identical tokens, mean tokens before the first difference)."""
    same = sum(a == b for a, b in zip(base, other, strict=True)) / len(base)
    prefix = []
    for a, b in zip(base, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n)
    return same, sum(prefix) / len(prefix)


def chat(llm: LLM, questions: Sequence[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def batch1_decode(llm: LLM, tokens: int = 48) -> float:
    """Output tokens per second of one request after its first token."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate(["The history of the printing press"], params, use_tqdm=False)[0]
    m = out.metrics
    return (tokens - 1) / (m.finished_time - m.first_token_time)


def throughput(llm: LLM, workload) -> float:
    """Output tokens per second with every request of the workload submitted at once."""
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload],
                        [r.sampling_params() for r in workload], use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def label(setting: Setting) -> str:
    """A row's name: what is quantized."""
    weights, kv = setting
    parts = ([f"{weights} weights"] if weights else []) + ([f"{kv} KV cache"] if kv != "auto" else [])
    return " + ".join(parts) or "none (float32)"


def quantization_benchmark(model, tokenizer, settings: Sequence[Setting] = SETTINGS, rounds: int = 3,
                           num_requests: int = 32, seed: int = 0, chunks: int = 16,
                           output_len: tuple[int, int] = (16, 128)) -> list[dict]:
    """One row per setting (the first is the baseline: every ratio and agreement is against
    it); ``output_len``: the range of the throughput workload's output lengths."""
    llms = {s: LLM(copy.deepcopy(model) if s[0] else model, tokenizer=tokenizer, quantization=s[0],
                   kv_cache_dtype=s[1], log_stats_interval=None) for s in settings}
    workload = chat_workload(tokenizer, num_requests, seed, output_len=output_len)
    speed: dict = {s: {"b1": [], "b32": []} for s in settings}
    for _ in range(rounds):  # interleaved: a disturbance slows every setting alike
        for s, llm in llms.items():
            speed[s]["b1"].append(batch1_decode(llm))
            speed[s]["b32"].append(throughput(llm, workload))
    text = text_chunks(tokenizer, chunks, 256)
    rows, base = [], None
    for s, llm in llms.items():
        greedy = chat(llm, AGREEMENT_PROMPTS, 48)
        answers = chat(llm, [t for t, _ in TASKS], 24)
        right = sum(a in tokenizer.decode(ids) for ids, (_, a) in zip(answers, TASKS, strict=True))
        engine = llm.llm_engine
        report = engine.quantization
        row = {"setting": label(s), "quantization": s[0] or "none", "kv_cache_dtype": s[1],
               "linear weights MB": (report.bytes_after if report else _linear_bytes(model)) / 1e6,
               "KV tokens per GiB": 2**30 // kv_cache_bytes_per_token(engine.model, engine.kv_cache_dtype),
               "batch-1 decode tok/s": statistics.median(speed[s]["b1"]),
               "batch-1 range": _spread(speed[s]["b1"]),
               f"{num_requests} requests out tok/s": statistics.median(speed[s]["b32"]),
               f"{num_requests} requests range": _spread(speed[s]["b32"]),
               "perplexity": perplexity(llm, text),
               "answers right": f"{right}/{len(TASKS)}"}
        base = base or (row, greedy)
        same, prefix = agreement(base[1], greedy)
        row.update({"batch-1 speedup": row["batch-1 decode tok/s"] / base[0]["batch-1 decode tok/s"],
                    "throughput ratio": row[f"{num_requests} requests out tok/s"]
                    / base[0][f"{num_requests} requests out tok/s"],
                    "perplexity change %": 100 * (row["perplexity"] / base[0]["perplexity"] - 1),
                    "greedy identical": same, "tokens before first difference": prefix})
        rows.append(row)
    for llm in llms.values():
        llm.close()
    return rows


def _spread(values: list[float]) -> str:
    """The lowest and highest of the rounds, to read a median by."""
    return f"{min(values):.1f}-{max(values):.1f}"


def _linear_bytes(model) -> int:
    from torch import nn

    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear)


def main(args: argparse.Namespace) -> int:
    """``minivllm bench quantization``: float32 against int8 weights and an fp8 KV cache, speed and quality."""
    from minivllm.worker.model_loader import load_model

    for flag, value in (("--rounds", args.rounds), ("--num-requests", args.num_requests)):
        if value is not None and value < 1:
            raise SystemExit(f"minivllm bench quantization: {flag} must be at least 1, got {value}")
    model, tokenizer = load_model(args.model)
    rows = quantization_benchmark(model, tokenizer, rounds=args.rounds, num_requests=args.num_requests or 32,
                                  seed=args.seed)
    for row in rows:
        print(", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    return 0
