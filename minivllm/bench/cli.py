"""``minivllm bench MODE``: one subcommand per benchmark, each with only the options it reads.

Each mode's ``main(args)`` lives in its own module beside the benchmark it runs, as in
vLLM's ``vllm/benchmarks/`` (``throughput.py``, ``latency.py``, ...), and vLLM's
``vllm bench SUB --help`` lists only that subcommand's flags; so does ``minivllm bench
SUB --help`` here. Adding a mode is a module with a ``main`` and one line in
:data:`MODES` naming the options it reads (from :data:`OPTIONS`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from minivllm.bench import (
    cluster,
    disagg,
    kv_offload,
    latency,
    linear,
    memory,
    prefix_caching,
    priority,
    quantization,
    roofline,
    router,
    serve,
    simulate,
    soak,
    speculative,
    tensor_parallel,
    throughput,
)
from minivllm.bench.common import ENGINE_SETTINGS, FIGURES
from minivllm.bench.tools import TOOLS
from minivllm.engine.arg_utils import add_engine_arguments
from minivllm.entrypoints.routing import ROUTING_POLICIES

ENGINE = ("block_size", "max_num_batched_tokens", "max_num_seqs")  # most modes' engine flags

MODES: dict[str, tuple[Callable[[argparse.Namespace], int], tuple[str, ...]]] = {
    # mode: (its main, the options it reads besides --model)
    "throughput": (throughput.main, (*ENGINE, "num_requests", "seed", "rounds", "tools", "figures")),
    "latency": (latency.main, (*ENGINE, "num_requests", "seed", "rates", "simulated",
                               "no_chunked_prefill_check", "figures")),
    "memory": (memory.main, ("block_size", "num_requests", "seed", "max_model_len", "figures")),
    "prefix": (prefix_caching.main, (*ENGINE, "num_requests", "seed", "rounds")),
    "offload": (kv_offload.main, ("block_size", "max_num_batched_tokens", "seed", "rounds", "prompt_lens")),
    "linear": (linear.main, ("rounds",)),
    "speculative": (speculative.main, ("block_size", "max_num_batched_tokens", "num_requests", "seed",
                                       "workloads", "spec_rows")),
    "priority": (priority.main, (*ENGINE, "num_requests", "seed", "num_interactive", "interactive_rate")),
    "roofline": (roofline.main, (*ENGINE, "num_requests", "seed", "roofline_settings", "figures")),
    "fit-simulator": (simulate.fit_main, ("num_requests", "out", "figures")),
    "calibrate": (simulate.calibrate_main, ("num_requests",)),
    "simulate": (simulate.simulate_main, (*ENGINE, "num_requests", "seed", "rate")),
    "simulate-cluster": (cluster.main, (*ENGINE, "num_requests", "seed", "cluster_replicas",
                                        "cluster_policies", "rate_per_replica", "figures")),
    "serve": (serve.main, ("block_size", "max_num_batched_tokens", "compilation_config", "num_requests", "seed",
                           "concurrencies",
                           "serve_rates", "prompt_len", "max_tokens", "serve_modes")),
    "tensor-parallel": (tensor_parallel.main, (*ENGINE, "num_requests", "tp_sizes", "tp_max_tokens",
                                               "distributed_executor_backend")),
    "router": (router.main, ("block_size", "seed", "num_documents", "questions_per_document",
                             "router_concurrency")),
    "quantization": (quantization.main, ("num_requests", "seed", "rounds")),
    "disagg": (disagg.main, ("seed", "chatters", "max_tokens", "long_len", "long_rate", "duration")),
    "simulate-disagg": (disagg.simulate_main, ("num_requests", "seed", "disagg_rates", "pools", "ttft_bound",
                                               "tpot_bound", "transfer_gb_per_s")),
    "soak": (soak.main, ("seed", "minutes", "fault_interval", "faults", "concurrency", "seats",
                         "max_waiting", "log")),
}

OPTIONS: dict[str, dict] = {  # the benchmarks' own options (not engine settings): argparse keywords
    "num_requests": dict(type=int, default=None,
                         help="requests in the workload (default 32; simulate: 10000; simulate-cluster: 2000)"),
    "seed": dict(type=int, default=0, help="the workload's seed"),
    "rounds": dict(type=int, default=3, help="interleaved rounds of each variant (median and middle half reported)"),
    "tools": dict(default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}"),
    "rates": dict(default="0.25,0.5,1,2", help="request rates (req/s)"),
    "simulated": dict(action="store_true", help="use the simulator, not the model"),
    "no_chunked_prefill_check": dict(action="store_true",
                                     help="skip the long-prompt-among-decodes comparison"),
    "max_model_len": dict(type=int, default=2048,
                          help="the contiguous reservation per request (not an engine setting)"),
    "rate": dict(type=float, default=None, help="Poisson rate (default: all at once)"),
    "workloads": dict(default="copy,chat", help="which workloads (copy, chat)"),
    "spec_rows": dict(default="0,2,4,8,4 (off above 4),auto",
                      help="the rows compared, comma-separated labels of minivllm.bench.speculative.SETTINGS "
                           "(0, the baseline, runs first in any case)"),
    "num_interactive": dict(type=int, default=12, help="interactive chat requests in the steady stream"),
    "interactive_rate": dict(type=float, default=1.0,
                             help="interactive requests per second, while the batch job runs"),
    "roofline_settings": dict(default="eager,compiled",
                              help="how the model runs, each measured on the same steps: 'eager', then "
                                   "'compiled' (compilation_config=3, about a minute to compile)"),
    "figures": dict(default=str(FIGURES), help="folder for the figures ('' for none)"),
    "concurrencies": dict(default="1,8,32", help="client concurrencies"),
    "serve_rates": dict(default="", help="a request-rate sweep, Poisson arrivals at each rate in requests "
                                         "per second (e.g. 0.5,1,2); none by default"),
    "prompt_len": dict(type=int, default=128, help="prompt tokens per request"),
    "max_tokens": dict(type=int, default=64, help="output tokens per request"),
    "serve_modes": dict(default="thread,process",
                        help="the servers to compare (thread: engine in the server process; process: "
                             "engine core in its own process)"),
    "cluster_replicas": dict(default="1,2,4,8,16,32,64", help="the replica counts swept"),
    "cluster_policies": dict(default=",".join(ROUTING_POLICIES), help="the routing policies compared"),
    "rate_per_replica": dict(type=float, default=2.0,
                             help="Poisson arrivals per second per replica (the rate grows with the "
                                  "replica count, so each replica sees the same load)"),
    "tp_sizes": dict(default="1,2,3", help="the tensor_parallel_size values compared (T=1 first)"),
    "tp_max_tokens": dict(type=int, default=32, help="greedy output tokens per request"),
    "distributed_executor_backend": dict(choices=("mp", "ray"), default="mp",
                                         help="who starts ranks 1..T-1: worker processes here ('mp') or "
                                              "Ray actors on the cluster ray.init() finds ('ray')"),
    "num_documents": dict(type=int, default=6, help="documents in the workload"),
    "questions_per_document": dict(type=int, default=4, help="questions asked about each document"),
    "router_concurrency": dict(type=int, default=4,
                               help="clients sending requests through the router at once"),
    "out": dict(default=None, help="where to write the cost model JSON"),
    "prompt_lens": dict(default="256,1024", help="prompt lengths in tokens, comma-separated"),
    "chatters": dict(type=int, default=4, help="chat clients streaming short prompts back to back"),
    "long_len": dict(type=int, default=1024, help="tokens of each long prompt"),
    "long_rate": dict(type=float, default=0.1, help="long prompts arriving per second (Poisson)"),
    "duration": dict(type=float, default=120.0, help="seconds of traffic per layout"),
    "pools": dict(default="1:3,2:2,3:1", help="prefill:decode instance counts compared, comma-separated"),
    "disagg_rates": dict(default="0.25,0.5,0.75,1,1.25", help="request rates swept (req/s)"),
    "ttft_bound": dict(type=float, default=10.0, help="time-to-first-token bound, seconds"),
    "tpot_bound": dict(type=float, default=0.12, help="time-per-output-token bound, seconds"),
    "transfer_gb_per_s": dict(type=float, default=2.0, help="KV transfer bandwidth between the pools, GB/s"),
    "minutes": dict(type=float, default=30.0, help="how long the soak runs"),
    "fault_interval": dict(type=float, default=20.0, help="seconds between two injected faults"),
    "faults": dict(default=",".join(soak.FAULTS), help=f"the fault cycle, a subset of {','.join(soak.FAULTS)}"),
    "concurrency": dict(type=int, default=4, help="clients sending requests back to back"),
    "seats": dict(type=int, default=8, help="the server's --max-num-seqs"),
    "max_waiting": dict(type=int, default=16, help="the server's --max-waiting"),
    "log": dict(default=None, help="the server's log file (default: soak-TIME.log here)"),
}


def _summary(main: Callable) -> str:
    """A mode's one-line help: its main's docstring, first paragraph, without the
    ``minivllm bench MODE``: prefix."""
    first = " ".join((main.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", "")
    return first.split(": ", 1)[1] if first.startswith("minivllm bench") and ": " in first else first


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``minivllm bench`` subcommands (shared by ``python -m minivllm.bench``)."""
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, (main, options) in MODES.items():
        summary = _summary(main)
        sub = modes.add_parser(name, help=summary, description=summary)
        add_engine_arguments(sub, ("model", *(o for o in options if o in ENGINE_SETTINGS)))
        for option in options:
            if option not in ENGINE_SETTINGS:
                sub.add_argument("--" + option.replace("_", "-"), **OPTIONS[option])


def run(args: argparse.Namespace) -> int:
    return MODES[args.mode][0](args)


def build_bench_parser() -> argparse.ArgumentParser:
    """``python -m minivllm.bench``'s parser (``minivllm bench`` adds the same subcommands)."""
    parser = argparse.ArgumentParser(prog="python -m minivllm.bench",
                                     description="Benchmarks: minivllm against the tools a reader would "
                                                 "otherwise use, on the same requests.")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_bench_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(args)
