"""Disaggregated mode: does splitting prefill from decode protect the decodes? (issue 33)

``minivllm bench disagg`` serves the same traffic with three layouts of the same cores:

* **one engine** with every core (``minivllm serve``);
* **two replicas** behind the router (``least_outstanding``), each with half the cores;
* **disaggregated**: a prefill instance (``kv_producer``) and a decode instance
  (``kv_consumer``), each with half the cores, joined by the ``SharedStorageConnector``'s
  folder, behind the router with ``--prefill``.

The traffic is what disaggregation is for: ``--chatters`` clients each stream short
prompts with long answers, back to back (the decodes whose inter-token latency a reader
of the answer feels), while long prompts (``--long-len`` tokens, a few output tokens)
arrive at random (a Poisson process of ``--long-rate`` per second). In one engine a long
prompt's prefill chunks share steps with the chatters' decodes and stretch them; split,
the decode instance never computes a long prompt, only loads its KV. Each layout runs for
``--duration`` seconds. Reported: the chatters' inter-token latency (p50, p90, p99) and
output tokens per second, the long prompts' time to first token (p50, p99), and whether one
fixed long prompt got the same greedy tokens in every layout.

What it cannot show on one small machine: the decode instance has half the cores, so its
steps are slower than one engine's whenever no long prompt is in the way; and the KV goes
through a folder (the page cache), not GPU to GPU. The layouts share one CPU, so a layout's
numbers are comparable only to the others' from the same run.

In vLLM: ``benchmarks/disagg_benchmarks/`` (a proxy and two ``vllm serve`` instances with
``--kv-transfer-config``) measures TTFT and ITL the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from minivllm.bench.serve import make_prompts, stream_completion
from minivllm.metrics import percentile
from minivllm.utils.system_utils import available_cpus

LAYOUTS = ("one engine", "two replicas", "disaggregated")


@dataclass
class DisaggRow:
    layout: str
    chat_requests: int
    chat_tok_s: float
    itl: tuple[float, float, float]
    """The chatters' inter-token latency, p50, p90, p99 (s)."""
    long_requests: int
    long_ttft: tuple[float, float]
    """The long prompts' time to first token, p50, p99 (s)."""
    probe: str
    """The greedy text of one fixed long prompt, served last."""


@contextlib.contextmanager
def layout_urls(layout: str, serve_argv: list[str], folder: str) -> Iterator[str]:
    """The layout's processes on this machine, and the one URL that serves it."""
    from minivllm.entrypoints.data_parallel import LocalReplicas
    from minivllm.entrypoints.openai.api_server import ServerThread
    from minivllm.entrypoints.router_app import build_router_app

    cores = str(available_cpus())
    half = {"OMP_NUM_THREADS": str(max(1, available_cpus() // 2))}
    quiet = {"log_dir": folder, "startup_timeout": 600}
    with contextlib.ExitStack() as stack:
        if layout == "one engine":
            one = stack.enter_context(LocalReplicas(1, serve_argv, env={"OMP_NUM_THREADS": cores}, **quiet))
            yield one.urls[0]
            return
        if layout == "two replicas":
            two = stack.enter_context(LocalReplicas(2, serve_argv, env=half, **quiet))
            app = build_router_app(two.urls, "least_outstanding")
        else:
            def connector(role: str) -> list[str]:
                return ["--kv-transfer-config", json.dumps({
                    "kv_connector": "SharedStorageConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": os.path.join(folder, "kv")}})]

            prefill = stack.enter_context(LocalReplicas(1, serve_argv + connector("kv_producer"), env=half,
                                                        **quiet))
            decode = stack.enter_context(LocalReplicas(1, serve_argv + connector("kv_consumer"), env=half,
                                                       **quiet))
            app = build_router_app(decode.urls, "least_outstanding", prefill=prefill.urls)
        yield stack.enter_context(ServerThread(app)).url


async def drive(url: str, chatters: int, chat_prompts: list[list[int]], chat_tokens: int,
                long_prompts: list[list[int]], long_rate: float, long_tokens: int, duration: float,
                seed: int) -> tuple[list, list]:
    """``chatters`` closed-loop chat clients and Poisson arrivals of long prompts for
    ``duration`` seconds; every request started is waited for. Returns the chat requests'
    (sent, chunk times, tokens) and the long ones' TTFTs."""
    import httpx

    chats, longs = [], []
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await stream_completion(http, chat_prompts[0], 2)  # warm up
        start = time.perf_counter()
        end = start + duration

        async def chatter(k: int) -> None:
            i = k
            while time.perf_counter() < end:
                sent, times, _, tokens = await stream_completion(http, chat_prompts[i % len(chat_prompts)],
                                                                 chat_tokens)
                chats.append((sent, times, tokens))
                i += chatters

        async def long_arrivals() -> None:
            tasks, i = [], 0
            while (now := time.perf_counter() + rng.exponential(1.0 / long_rate)) < end:
                await asyncio.sleep(now - time.perf_counter())
                tasks.append(asyncio.ensure_future(
                    stream_completion(http, long_prompts[i % len(long_prompts)], long_tokens)))
                i += 1
            for sent, times, _, _ in await asyncio.gather(*tasks):
                longs.append(times[0] - sent)

        await asyncio.gather(long_arrivals(), *(chatter(k) for k in range(chatters)))
    return chats, longs


async def probe(url: str, prompt: list[int], tokens: int) -> str:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        _, _, texts, _ = await stream_completion(http, prompt, tokens)
    return "".join(texts)


def fixed_prompt(long_len: int, vocab_size: int, seed: int) -> list[int]:
    """The long prompt every layout is asked last, to compare their greedy tokens."""
    return make_prompts(1, long_len, vocab_size, seed + 2)[0]


def disagg_benchmark(model: str, chatters: int = 4, chat_len: int = 32, chat_tokens: int = 64,
                     long_len: int = 1024, long_rate: float = 0.1, long_tokens: int = 4,
                     duration: float = 120.0, seed: int = 0, vocab_size: int = 49152,
                     layouts: tuple[str, ...] = LAYOUTS, extra_argv: tuple[str, ...] = ()) -> list[DisaggRow]:
    """Each layout in turn, the same traffic (the same prompts and arrival times' seed)."""
    chat_prompts = make_prompts(64, chat_len, vocab_size, seed)
    long_prompts = make_prompts(64, long_len, vocab_size, seed + 1)
    fixed = fixed_prompt(long_len, vocab_size, seed)
    argv = ["--model", model, "--log-stats-interval", "0", "--max-model-len", str(long_len + 64),
            "--max-num-seqs", str(chatters + 8), *extra_argv]
    rows = []
    for layout in layouts:
        with tempfile.TemporaryDirectory() as folder, layout_urls(layout, argv, folder) as url:
            chats, longs = asyncio.run(drive(url, chatters, chat_prompts, chat_tokens, long_prompts,
                                             long_rate, long_tokens, duration, seed))
            text = asyncio.run(probe(url, fixed, 8))
        gaps = [g for _, times, _ in chats for g in np.diff(times)]
        span = max(t[-1] for _, t, _ in chats) - min(s for s, _, _ in chats)
        rows.append(DisaggRow(layout, len(chats), sum(n for _, _, n in chats) / span,
                              (percentile(gaps, 50), percentile(gaps, 90), percentile(gaps, 99)),
                              len(longs), (percentile(longs, 50), percentile(longs, 99)), text))
    return rows


def format_disagg_table(rows: list[DisaggRow]) -> str:
    lines = ["| layout | chat requests | chat out tok/s | chat ITL p50 / p90 / p99 (ms) "
             "| long prompts | long TTFT p50 / p99 (ms) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.layout} | {r.chat_requests} | {r.chat_tok_s:.1f} | "
                     f"{' / '.join(f'{x * 1e3:.0f}' for x in r.itl)} | {r.long_requests} | "
                     f"{' / '.join(f'{x * 1e3:.0f}' for x in r.long_ttft)} |")
    same = len({r.probe for r in rows}) == 1
    lines.append("")
    lines.append("one fixed long prompt, 8 greedy tokens: "
                 f"{'the same text in every layout' if same else 'TEXTS DIFFER: ' + repr([r.probe for r in rows])}")
    return "\n".join(lines)


def _positive(args: argparse.Namespace, names: tuple[str, ...]) -> str | None:
    """The refusal of the first of ``names`` that is not a finite number > 0, or None."""
    for name in names:
        value = getattr(args, name)
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            return f"--{name.replace('_', '-')} must be a number > 0, got {value!r}"
    return None


def _pools(text: str) -> list[tuple[int, int]] | None:
    """``"1:3,2:2"`` as [(1, 3), (2, 2)], or None when it is not that shape."""
    try:
        pools = [tuple(int(x) for x in pool.split(":")) for pool in text.split(",")]
    except ValueError:
        return None
    return pools if pools and all(len(p) == 2 and min(p) >= 1 for p in pools) else None


def main(args: argparse.Namespace) -> int:
    """``minivllm bench disagg``: one engine, two replicas and a prefill/decode split on the
    same cores, under chat streams with long prompts arriving among them."""
    from minivllm.bench.common import load_tokenizer

    refused = _positive(args, ("chatters", "max_tokens", "long_len", "long_rate", "duration"))
    if refused:
        print(refused)
        return 2
    vocab = len(load_tokenizer(args.model))
    rows = disagg_benchmark(args.model, args.chatters, 32, args.max_tokens, args.long_len, args.long_rate,
                            4, args.duration, args.seed, vocab)
    print(f"{args.chatters} chat streams ({args.max_tokens} tokens each, back to back) and "
          f"{args.long_len}-token prompts arriving at {args.long_rate:g}/s, {args.duration:g} s per layout, "
          f"{available_cpus()} cores:")
    print(format_disagg_table(rows))
    return 0 if len({r.probe for r in rows}) == 1 else 1


# -- simulated: the goodput sweep ------------------------------------------------------------
def format_goodput(rows: list[dict], ttft_bound: float, tpot_bound: float) -> str:
    lines = [f"| req/s | layout | within TTFT <= {ttft_bound:g} s and TPOT <= {tpot_bound * 1e3:g} ms "
             "| TTFT p50 / p90 (s) | TPOT p50 / p90 (ms) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['layout']} | {100 * r['attainment']:.0f}% | "
                     f"{r['ttft_p50']:.1f} / {r['ttft_p90']:.1f} | "
                     f"{r['tpot_p50'] * 1e3:.0f} / {r['tpot_p90'] * 1e3:.0f} |")
    lines.append("")
    for layout in dict.fromkeys(r["layout"] for r in rows):
        good = [r["rate"] for r in rows if r["layout"] == layout and r["attainment"] >= 0.9]
        lines.append(f"goodput of {layout} (the highest rate swept with >= 90% within both bounds): "
                     + (f"{max(good):g} req/s" if good else "below the lowest rate swept"))
    return "\n".join(lines)


def simulate_main(args: argparse.Namespace) -> int:
    """``minivllm bench simulate-disagg``: a prefill pool and a decode pool against as many
    colocated replicas, in simulated time, at each request rate: the share of requests
    within a TTFT and a TPOT bound (DistServe's goodput)."""
    from minivllm.sim.disagg_simulator import goodput_sweep
    from minivllm.sim.workload import make_workload

    try:
        rates = [float(r) for r in args.disagg_rates.split(",")]
    except ValueError:
        rates = []
    pools = _pools(args.pools)
    refused = _positive(args, ("ttft_bound", "tpot_bound", "transfer_gb_per_s"))
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        refused = f"--disagg-rates takes comma-separated request rates > 0, got {args.disagg_rates!r}"
    elif pools is None:
        refused = f"--pools takes comma-separated PREFILL:DECODE instance counts >= 1, got {args.pools!r}"
    elif args.num_requests is not None and args.num_requests < 1:
        refused = f"--num-requests must be >= 1, got {args.num_requests}"
    if refused:
        print(refused)
        return 2
    n = args.num_requests or 200

    def workload(rate: float):
        return make_workload(None, n, seed=args.seed, prompt_len=(256, 2048), output_len=(32, 256), rate=rate)

    for p, d in pools:
        logger = logging.getLogger("minivllm")
        level = logger.level
        logger.setLevel(max(level, logging.WARNING))  # not a KV-cache line per simulated engine
        try:
            rows = goodput_sweep(workload, rates, p, d, args.ttft_bound, args.tpot_bound, args.transfer_gb_per_s)
        finally:
            logger.setLevel(level)
        print(f"{n} requests (prompts 256-2048 tokens, answers 32-256), KV over "
              f"{args.transfer_gb_per_s:g} GB/s, {p} prefill + {d} decode against {p + d} colocated:")
        print(format_goodput(rows, args.ttft_bound, args.tpot_bound))
        print()
    return 0
