"""``minivllm bench MODE``: one flat set of options, and a table from mode to function.

Each mode's ``main(args)`` lives in its own module beside the benchmark it runs, as in
vLLM's ``vllm/benchmarks/`` (``throughput.py``, ``latency.py``, ...). Adding a mode is a
module with a ``main`` and one line in :data:`MODES`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from minivllm.bench import (
    cluster,
    latency,
    linear,
    memory,
    prefix_caching,
    priority,
    roofline,
    router,
    serve,
    simulate,
    speculative,
    tensor_parallel,
    throughput,
)
from minivllm.bench.common import ENGINE_SETTINGS, FIGURES
from minivllm.bench.tools import TOOLS
from minivllm.config import add_engine_arguments
from minivllm.routing import ROUTING_POLICIES

MODES: dict[str, Callable[[argparse.Namespace], int]] = {
    "throughput": throughput.main,
    "latency": latency.main,
    "memory": memory.main,
    "prefix": prefix_caching.main,
    "linear": linear.main,
    "speculative": speculative.main,
    "priority": priority.main,
    "roofline": roofline.main,
    "fit-simulator": simulate.fit_main,
    "calibrate": simulate.calibrate_main,
    "simulate": simulate.simulate_main,
    "simulate-cluster": cluster.main,
    "serve": serve.main,
    "tensor-parallel": tensor_parallel.main,
    "router": router.main,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``minivllm bench`` options (shared by ``python -m minivllm.bench``)."""
    parser.add_argument("mode", choices=list(MODES))
    add_engine_arguments(parser, ("model", *ENGINE_SETTINGS))
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests in the workload (default 32; simulate: 10000; simulate-cluster: 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="throughput, prefix, linear: interleaved rounds of each variant (median and "
                             "middle half reported)")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    parser.add_argument("--rates", default="0.25,0.5,1,2", help="latency: request rates (req/s)")
    parser.add_argument("--simulated", action="store_true", help="latency: use the simulator, not the model")
    parser.add_argument("--no-chunked-prefill-check", action="store_true",
                        help="latency: skip the long-prompt-among-decodes comparison")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="memory: the contiguous reservation per request (not an engine setting)")
    parser.add_argument("--rate", type=float, default=None, help="simulate: Poisson rate (default: all at once)")
    parser.add_argument("--workloads", default="copy,chat", help="speculative: which workloads (copy, chat)")
    parser.add_argument("--spec-rows", default="0,2,4,8,4 (off above 4),auto",
                        help="speculative: the rows compared, comma-separated labels of "
                             "minivllm.bench.speculative.SETTINGS (0, the baseline, runs first in any case)")
    parser.add_argument("--num-interactive", type=int, default=12,
                        help="priority: interactive chat requests in the steady stream")
    parser.add_argument("--interactive-rate", type=float, default=1.0,
                        help="priority: interactive requests per second, while the batch job runs")
    parser.add_argument("--figures", default=str(FIGURES), help="folder for the figures ('' for none)")
    parser.add_argument("--concurrencies", default="1,8,32", help="serve: client concurrencies")
    parser.add_argument("--serve-rates", default="",
                        help="serve: a request-rate sweep, Poisson arrivals at each rate in requests "
                             "per second (e.g. 0.5,1,2); none by default")
    parser.add_argument("--prompt-len", type=int, default=128, help="serve: prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=64, help="serve: output tokens per request")
    parser.add_argument("--serve-modes", default="thread,process",
                        help="serve: the servers to compare (thread: engine in the server process; "
                             "process: engine core in its own process)")
    parser.add_argument("--cluster-replicas", default="1,2,4,8,16,32,64",
                        help="simulate-cluster: the replica counts swept")
    parser.add_argument("--cluster-policies", default=",".join(ROUTING_POLICIES),
                        help="simulate-cluster: the routing policies compared")
    parser.add_argument("--rate-per-replica", type=float, default=2.0,
                        help="simulate-cluster: Poisson arrivals per second per replica (the rate "
                             "grows with the replica count, so each replica sees the same load)")
    parser.add_argument("--tp-sizes", default="1,2,3",
                        help="tensor-parallel: the tensor_parallel_size values compared (T=1 first)")
    parser.add_argument("--tp-max-tokens", type=int, default=32,
                        help="tensor-parallel: greedy output tokens per request")
    parser.add_argument("--num-documents", type=int, default=6, help="router: documents in the workload")
    parser.add_argument("--questions-per-document", type=int, default=4,
                        help="router: questions asked about each document")
    parser.add_argument("--router-concurrency", type=int, default=4,
                        help="router: clients sending requests through the router at once")
    parser.add_argument("--out", default=None, help="fit-simulator: where to write the cost model JSON")


def run(args: argparse.Namespace) -> int:
    return MODES[args.mode](args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.bench",
                                     description="Benchmarks: minivllm against the tools a reader would "
                                                 "otherwise use, on the same requests.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(args)
