"""Router mode: which replica a request lands on decides the prefix-cache hit rate.

``minivllm bench router`` starts two ``minivllm serve`` replicas (processes, each its own
engine and prefix cache, one CPU thread each) and the router of :mod:`minivllm.entrypoints.router` in
front of them, and sends :func:`~minivllm.sim.workload.document_workload` through it: groups
of questions over a shared long document, interleaved, as completions of token ids (the
chat template already applied), greedy with ``ignore_eos``. It does so once per routing
policy, on the same replicas, emptying their prefix caches before each policy
(``POST /reset_prefix_cache``, vLLM's development endpoint): every policy starts with
cold caches, and the replicas load the model once. A closed
loop of ``--router-concurrency`` clients sends the requests in the workload's order.

Per policy: the prefix-cache hit rate (prompt tokens whose KV came from the cache, over
all replicas, from their own ``/metrics``), mean time to first token, output tokens per
second, the requests each replica served (the router's count), and whether the greedy
outputs equal the first policy's (they must: routing changes where, not what).

Round robin sends a document's questions to both replicas, so each replica computes each
document; prefix-aware sends them where the document already is. On two cores the
replicas share the machine, so TTFT and throughput show what recomputation costs here,
not what a second GPU buys (the simulator's N-replica mode is for that).

In vLLM: ``vllm bench serve`` against a router (``vllm-project/router``) in front of
several ``vllm serve`` instances.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from minivllm.bench.priority import format_priority_table
from minivllm.bench.serve import stream_completion
from minivllm.entrypoints.routing import ROUTING_POLICIES
from minivllm.sim.workload import WorkloadRequest


async def _one(http, req: WorkloadRequest) -> tuple[float, str, int]:
    """Stream one completion through the router: its TTFT, text and output token count."""
    sent, times, texts, tokens = await stream_completion(http, req.prompt_token_ids, req.max_tokens)
    return (times[0] if times else time.perf_counter()) - sent, "".join(texts), tokens


async def _drive(url: str, workload: Sequence[WorkloadRequest], concurrency: int) -> tuple[dict, float]:
    """A closed loop of ``concurrency`` clients; results by request id, and the span."""
    import httpx

    queue = list(reversed(workload))
    results: dict[str, tuple[float, str, int]] = {}

    async def worker(http) -> None:
        while queue:
            req = queue.pop()
            results[req.request_id] = await _one(http, req)

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return results, time.perf_counter() - start


def _prefix_counts(url: str) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
              for s in f.samples}
    return values["minivllm:prefix_cache_hits_total"], values["minivllm:prefix_cache_queries_total"]


def router_benchmark(workload: Sequence[WorkloadRequest], model: str,
                     policies: Sequence[str] = ROUTING_POLICIES, num_replicas: int = 2,
                     concurrency: int = 4, serve_argv: Sequence[str] = (), block_size: int = 16,
                     data_parallel_backend: str = "mp") -> list[dict]:
    """One row per policy, all on the same ``num_replicas`` replica processes of ``model``
    (``serve_argv``: more ``minivllm serve`` flags), whose prefix caches are emptied
    (``POST /reset_prefix_cache``) before each policy: every policy starts cold, and the
    replicas load the model once. ``data_parallel_backend``: "mp", local processes;
    "ray", Ray actors on the cluster ``ray.init()`` finds. Each row's "outputs" holds the
    answers by request id (not printed)."""
    from minivllm.entrypoints.data_parallel import LocalReplicas

    argv = ["--model", model, "--no-engine-process", "--log-stats-interval", "0", "--block-size",
            str(block_size), "--uvicorn-log-level", "warning", *serve_argv]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    with tempfile.TemporaryDirectory() as logs:
        if data_parallel_backend == "ray":
            from minivllm.entrypoints.ray_replicas import RayReplicas

            replicas = RayReplicas(num_replicas, argv, env=env)
        else:
            replicas = LocalReplicas(num_replicas, argv, log_dir=logs, env=env)
        with replicas:
            return _run_policies(replicas.urls, workload, model, policies, concurrency, block_size)


def _run_policies(urls: Sequence[str], workload: Sequence[WorkloadRequest], model: str,
                  policies: Sequence[str], concurrency: int, block_size: int) -> list[dict]:
    import httpx

    from minivllm.entrypoints.openai.api_server import ServerThread
    from minivllm.entrypoints.router_app import build_router_app

    rows, first = [], None
    for url in urls:  # first-call costs, with a prompt shorter than a block: no cache entry
        httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=600)
    for policy in policies:
        for url in urls:
            httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
        before = [_prefix_counts(u) for u in urls]
        app = build_router_app(urls, policy, model=model, block_size=block_size)
        with ServerThread(app) as rt:
            # in a thread of its own: a Jupyter kernel already runs an event loop here
            with ThreadPoolExecutor(1) as pool:
                results, span = pool.submit(asyncio.run, _drive(rt.url, workload, concurrency)).result()
        after = [_prefix_counts(u) for u in urls]
        served = app.state.router.stats.requests
        hits = sum(a[0] - b[0] for a, b in zip(after, before))
        queries = sum(a[1] - b[1] for a, b in zip(after, before))
        texts = {rid: r[1] for rid, r in results.items()}
        first = first or texts
        rows.append({"policy": policy, "hit rate": hits / queries if queries else 0.0,
                     "mean TTFT s": sum(r[0] for r in results.values()) / len(results),
                     "output tok/s": sum(r[2] for r in results.values()) / span,
                     "per replica": "/".join(str(served[u]) for u in urls),
                     "same outputs": texts == first, "outputs": texts})
    return rows


def format_router_table(rows: Sequence[dict]) -> str:
    return format_priority_table([{k: v for k, v in row.items() if k != "outputs"} for row in rows])


def main(args: argparse.Namespace) -> int:
    """``minivllm bench router``: document_workload through 2 replicas, once per policy."""
    from minivllm.bench.common import load_tokenizer
    from minivllm.sim.workload import document_workload

    t = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replicas share the cores: one each
    workload = document_workload(load_tokenizer(args.model), num_documents=args.num_documents,
                                 questions_per_document=args.questions_per_document, seed=args.seed,
                                 output_len=(16, 32))
    rows = router_benchmark(workload, args.model, concurrency=args.router_concurrency,
                            block_size=args.block_size)
    print(f"{len(workload)} requests: {args.num_documents} documents x {args.questions_per_document} "
          f"questions, 2 replicas, {args.router_concurrency} clients")
    print(format_router_table(rows))
    print(f"wall time, the replicas' start-up included: {time.perf_counter() - t:.0f} s")
    return 0 if all(r["same outputs"] for r in rows) else 1
