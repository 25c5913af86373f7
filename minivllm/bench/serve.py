"""Serve mode: does the server keep up with its engine?

``minivllm bench serve`` starts ``minivllm serve`` in a process of its own, twice: with
the engine core on a thread of the server process (``--no-engine-process``, the design
before notebook 10's split) and in its own process (the default). An async HTTP client
streams the same requests to each at fixed concurrencies (a closed loop: each of ``c``
workers sends its next request when the previous one ends), and the same requests run
through the offline engine with ``max_num_seqs = c``. Each row: output tokens per second
(and its ratio to the offline engine's), time to first token and inter-token latency
percentiles, as the client saw them.

``--serve-rates`` adds a request-rate sweep (an open loop, as ``vllm bench serve
--request-rate`` does): requests arrive as a Poisson process at each rate, whether or not
earlier ones have finished, so a server that falls behind builds a queue, and its TTFT
shows it. Rate rows have no offline twin (the offline engine gets every request at once),
so their "x offline" column is empty.

Prompts are random token ids (``--prompt-len``, 128 by default) with ``ignore_eos``, so
every request makes exactly ``--max-tokens`` tokens (64), everywhere. The offline
engine gets all requests at once, so its TTFT is counted from each request's admission
(as a closed-loop client's request is admitted when it arrives).

In vLLM: ``vllm bench serve`` (``vllm/benchmarks/serve.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from minivllm.bench.common import engine_settings
from minivllm.metrics import percentile

CONCURRENCIES = (1, 8, 32)


@dataclass
class ServeRow:
    mode: str
    """"offline", "server (thread)" or "server (process)"."""
    concurrency: int
    num_requests: int
    output_tokens: int
    output_tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    rate: float | None = None
    """Requests per second of a Poisson arrival sweep row; None for a closed-loop row."""


def make_prompts(n: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size, size=(n, prompt_len)).tolist()


def summarise(mode: str, concurrency: int, tokens: int, span: float, ttfts: list[float],
              itls: list[float], n: int, rate: float | None = None) -> ServeRow:
    return ServeRow(mode, concurrency, n, tokens, tokens / span, percentile(ttfts, 50), percentile(ttfts, 99),
                    percentile(itls, 50), percentile(itls, 99), rate)


# -- offline --------------------------------------------------------------------------------
def run_offline(prompts: list[list[int]], max_tokens: int, concurrency: int, settings: dict) -> ServeRow:
    """All requests at once into an engine that runs ``concurrency`` of them at a time."""
    from minivllm import LLM, SamplingParams

    llm = LLM(**{**settings, "max_num_seqs": concurrency, "log_stats_interval": None})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    span = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # TTFT from admission: a closed-loop client's request is admitted as it arrives.
    ttfts = [o.metrics.first_token_time - o.metrics.first_scheduled_time for o in outs]
    return summarise("offline", concurrency, tokens, span, ttfts,
                     [x for o in outs for x in o.metrics.itls], len(outs))


# -- against a server -------------------------------------------------------------------------
async def stream_completion(http, prompt: list[int], max_tokens: int
                            ) -> tuple[float, list[float], list[str], int]:
    """Stream one greedy completion (``ignore_eos``): when it was sent, when each text
    chunk arrived, the chunks, and the output token count the server reported."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times, texts, tokens = [], [], 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
                texts.append(chunk["choices"][0]["text"])
    return sent, times, texts, tokens


async def one_request(http, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """Stream one completion; return its TTFT, inter-chunk gaps and output token count."""
    sent, times, _, tokens = await stream_completion(http, prompt, max_tokens)
    return times[0] - sent, list(np.diff(times)), tokens


async def drive(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int, mode: str) -> ServeRow:
    """A closed loop of ``concurrency`` workers over the prompts."""
    import httpx

    queue = list(reversed(prompts))
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await one_request(http, prompts[0], 4)  # warm up

        async def worker() -> None:
            while queue:
                results.append(await one_request(http, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        span = time.perf_counter() - start
    return summarise(mode, concurrency, sum(r[2] for r in results), span, [r[0] for r in results],
                     [x for r in results for x in r[1]], len(results))


async def drive_poisson(url: str, prompts: list[list[int]], max_tokens: int, rate: float, mode: str,
                        seed: int = 0) -> ServeRow:
    """An open loop: request i is sent at the i-th arrival of a Poisson process of ``rate``
    requests per second (exponential gaps), however many are still running. Its
    concurrency column is the most requests that were in flight at once."""
    import httpx

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(prompts))
    in_flight, most = 0, 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await one_request(http, prompts[0], 4)  # warm up

        async def arrive(delay: float, prompt: list[int]) -> tuple[float, list[float], int]:
            nonlocal in_flight, most
            await asyncio.sleep(delay)
            in_flight += 1
            most = max(most, in_flight)
            try:
                return await one_request(http, prompt, max_tokens)
            finally:
                in_flight -= 1

        start = time.perf_counter()
        results = await asyncio.gather(*(arrive(t, p) for t, p in zip(np.cumsum(gaps), prompts)))
        span = time.perf_counter() - start
    return summarise(mode, most, sum(r[2] for r in results), span, [r[0] for r in results],
                     [x for r in results for x in r[1]], len(results), rate)


def start_server(engine_process: bool, settings: dict, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """``minivllm serve`` in a process of its own; returns once ``/health`` says 200."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}"
             for k, v in settings.items() if v is not None]
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", f"--port={port}",
           "--engine-process" if engine_process else "--no-engine-process",
           "--log-stats-interval=0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def serve_benchmark(prompts_for: dict[int, list[list[int]]], max_tokens: int, settings: dict,
                    modes: tuple[str, ...] = ("thread", "process"),
                    rates: dict[float, list[list[int]]] | None = None) -> list[ServeRow]:
    """Offline, then each server mode, at every concurrency, then at every request rate
    (Poisson arrivals); rows in that order."""
    rows = [run_offline(p, max_tokens, c, settings) for c, p in prompts_for.items()]
    server_settings = {**settings, "max_num_seqs": max(prompts_for)}
    for mode in modes:
        proc, url = start_server(mode == "process", server_settings)
        try:
            for c, prompts in prompts_for.items():
                rows.append(asyncio.run(drive(url, prompts, max_tokens, c, f"server ({mode})")))
            for rate, prompts in (rates or {}).items():
                rows.append(asyncio.run(drive_poisson(url, prompts, max_tokens, rate, f"server ({mode})")))
        finally:
            proc.terminate()
            proc.wait(60)
    return rows


def format_rows(rows: list[ServeRow]) -> str:
    offline = {r.concurrency: r.output_tok_s for r in rows if r.mode == "offline"}
    lines = ["| mode | load | requests | out tok/s | x offline | TTFT p50 / p99 (ms) "
             "| ITL p50 / p99 (ms) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r.rate is not None, r.rate or r.concurrency, r.mode)):
        load = f"concurrency {r.concurrency}" if r.rate is None else (
            f"{r.rate:g} req/s (at most {r.concurrency} in flight)")
        ratio = "" if r.rate is not None else f"{r.output_tok_s / offline[r.concurrency]:.2f}"
        lines.append(f"| {r.mode} | {load} | {r.num_requests} | {r.output_tok_s:.1f} | "
                     f"{ratio} | {r.ttft_p50 * 1e3:.0f} / "
                     f"{r.ttft_p99 * 1e3:.0f} | {r.itl_p50 * 1e3:.0f} / {r.itl_p99 * 1e3:.0f} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``minivllm bench serve``: the server (engine on a thread, then in its own process) and
    the offline engine, streaming the same requests."""
    from minivllm.bench.common import load_tokenizer

    settings = {"model": args.model, **engine_settings(args)}
    # (no --max-num-seqs: each concurrency sets it)
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    vocab = len(load_tokenizer(args.model))
    prompts_for = {c: make_prompts(args.num_requests or max(4, 2 * c), args.prompt_len, vocab,
                                   args.seed + c) for c in concurrencies}
    rates = {float(r): make_prompts(args.num_requests or 16, args.prompt_len, vocab, args.seed + 1000 + i)
             for i, r in enumerate(args.serve_rates.split(",")) if r}
    if any(r <= 0 for r in rates):
        raise SystemExit(f"--serve-rates must be positive requests per second, got {args.serve_rates!r}")
    modes = tuple(args.serve_modes.split(","))
    rows = serve_benchmark(prompts_for, args.max_tokens, settings, modes, rates)
    print(format_rows(rows))
    return 0
