"""The ``minivllm`` command: ``minivllm generate "prompt"``, ``minivllm serve``, ``minivllm check`` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import logging
import sys

from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import add_engine_arguments, engine_kwargs
from minivllm.entrypoints.routing import ROUTING_POLICIES
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import DEFAULT_MODEL

GENERATE_SETTINGS = ("model", "max_model_len", "attention_backend", "linear_backend", "dtype", "quantization",
                     "kv_cache_dtype", "device",
                     "tensor_parallel_size", "distributed_executor_backend", "speculative_config",
                     "compilation_config", "enforce_eager", "async_scheduling")
"""The engine settings ``minivllm generate`` takes (its ``--seed`` is the sampling seed)."""
SERVE_SETTINGS = tuple(name for name in EngineConfig.__dataclass_fields__ if name != "max_trace_steps")
"""Every engine setting, except the trace's length: a server keeps its last 1000 steps."""


def _generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams

    # Only its own engine settings: its --seed is the request's (sampling) seed, not the engine's.
    llm = LLM(**{name: getattr(args, name) for name in GENERATE_SETTINGS})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    messages = [{"role": "user", "content": args.prompt}]
    if args.raw:
        pieces = llm.stream(args.prompt, params)
    else:
        pieces = llm.stream(messages, params)
    for piece in pieces:
        print(piece, end="", flush=True)
    print()
    llm.close()  # ends the tensor-parallel workers, if any
    return 0


def _serve(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.openai.api_server import run_server

    if args.data_parallel_size != 1:
        from minivllm.entrypoints.data_parallel import engine_argv, run_data_parallel

        serve_argv = [*engine_argv(engine_kwargs(args)), "--max-waiting", str(args.max_waiting),
                      "--max-request-bytes", str(args.max_request_bytes),
                      "--engine-process" if args.engine_process else "--no-engine-process",
                      "--uvicorn-log-level", args.uvicorn_log_level]
        if args.api_key is not None:
            serve_argv += ["--api-key", *args.api_key]
        if args.cache_salt_per_key:
            serve_argv += ["--cache-salt-per-key"]
        run_data_parallel(args.data_parallel_size, serve_argv, args.routing_policy, args.host, args.port,
                          backend=args.data_parallel_backend, model=args.model, block_size=args.block_size, api_key=args.api_key,
                          tenants_file=args.tenants, max_request_bytes=args.max_request_bytes,
                          uvicorn_log_level=args.uvicorn_log_level)
        return 0

    run_server(args.host, args.port, api_key=args.api_key, tenants_file=args.tenants,
               cache_salt_per_key=args.cache_salt_per_key, max_waiting=args.max_waiting,
               max_request_bytes=args.max_request_bytes, engine_process=args.engine_process,
               uvicorn_log_level=args.uvicorn_log_level, **engine_kwargs(args))
    return 0


def _router(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.router_app import run_router

    run_router(args.replica, args.routing_policy, args.host, args.port, model=args.model,
               block_size=args.block_size, api_key=args.api_key, tenants_file=args.tenants, prefill=args.prefill,
               health_interval=args.health_interval,
               uvicorn_log_level=args.uvicorn_log_level)
    return 0


def _warmup(args: argparse.Namespace) -> int:
    from minivllm.worker.warmup import warmup

    warmup(args.model, reconvert=args.reconvert, max_tokens=args.max_tokens)
    return 0


def _check(args: argparse.Namespace) -> int:
    from minivllm.check import main

    return main(args.piece, args.spec, args.select)


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def build_parser() -> argparse.ArgumentParser:
    """The ``minivllm`` command's parser (the docs' CLI reference is generated from it).
    One helper per subcommand, added in the order ``minivllm --help`` lists them."""
    from minivllm.bench.cli import add_arguments as add_bench_arguments
    from minivllm.bench.cli import run as run_bench

    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, memory) and the simulator")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)
    _add_serve_parser(sub)
    _add_router_parser(sub)
    _add_warmup_parser(sub)
    _add_check_parser(sub)
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream one answer from the model")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed of the request")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_arguments(gen, GENERATE_SETTINGS)
    gen.set_defaults(func=_generate)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from minivllm.entrypoints.openai.api_server import (
        DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_MAX_WAITING,
    )

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1, for any of these keys "
                          "(several keys, or the flag repeated: each key is a tenant)")
    srv.add_argument("--tenants", default=None, metavar="FILE",
                     help='JSON file of tenants: {"tenants": [{"name": ..., "api_key": ..., '
                          '"max_concurrent_requests": N, "max_tokens_per_minute": N}]}; over a '
                          "limit, HTTP 429 with Retry-After; usage per tenant in /metrics")
    srv.add_argument("--cache-salt-per-key", action="store_true",
                     help="salt each API key's prompts apart in the prefix cache, so no tenant's "
                          "requests hit blocks another tenant's requests cached")
    srv.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                     help="refuse new requests (HTTP 503) while this many wait for a seat")
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                     help="refuse request bodies larger than this (HTTP 413; default 1 MiB)")
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                     help="run the engine core in its own process (default); --no-engine-process: "
                          "on a thread of the server process")
    srv.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                     help="uvicorn's log level (info: one access line per request); with "
                          "--data-parallel-size, the router's and every replica's")
    srv.add_argument("--data-parallel-size", type=int, default=1,
                     help="start this many replicas (each its own engine and caches) on free local "
                          "ports, and a router in front of them on --port")
    srv.add_argument("--data-parallel-backend", choices=("mp", "ray"), default="mp",
                     help="with --data-parallel-size > 1: 'mp' starts the replicas as processes on "
                          "this machine; 'ray' as Ray actors on the nodes of a Ray cluster, restarted "
                          'when they die (pip install "minivllm[ray]")')
    srv.add_argument("--routing-policy", choices=ROUTING_POLICIES, default="least_outstanding",
                     help="with --data-parallel-size > 1: how the router picks a replica")
    add_engine_arguments(srv, SERVE_SETTINGS)
    srv.set_defaults(func=_serve)


def _add_router_parser(sub: argparse._SubParsersAction) -> None:
    rt = sub.add_parser("router", help="one OpenAI-compatible endpoint in front of running replicas")
    rt.add_argument("--replica", action="append", required=True, metavar="URL",
                    help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each); "
                         "with --prefill, the decode instances")
    rt.add_argument("--prefill", action="append", default=[], metavar="URL",
                    help="disaggregated prefill: a prefill instance's URL (a minivllm serve with a "
                         "kv_producer --kv-transfer-config; repeat for each). Each request is "
                         "sent to one with max_tokens 1, then to a --replica (a kv_consumer)")
    rt.add_argument("--routing-policy", choices=ROUTING_POLICIES, default="least_outstanding")
    rt.add_argument("--model", default=DEFAULT_MODEL,
                    help="the replicas' model: prefix_aware loads its tokenizer (not the weights)")
    rt.add_argument("--block-size", type=int, default=16, help="the replicas' KV-cache block size")
    rt.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    rt.add_argument("--port", type=int, default=8000)
    rt.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1 for any of these keys "
                         "(the header is forwarded)")
    rt.add_argument("--tenants", default=None, metavar="FILE",
                    help="JSON file of tenants, as minivllm serve takes it: the router holds "
                         "their limits for all the replicas (start these with the same keys)")
    rt.add_argument("--health-interval", type=float, default=2.0,
                    help="seconds between probes of every replica's /health")
    rt.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                    help="uvicorn's log level (info: one access line per request)")
    rt.set_defaults(func=_router)


def _add_warmup_parser(sub: argparse._SubParsersAction) -> None:
    warm = sub.add_parser("warmup", help="convert and cache the model before a session; say how long it took")
    warm.add_argument("--model", default=DEFAULT_MODEL)
    warm.add_argument("--max-tokens", type=int, default=16, help="length of the one test generation")
    warm.add_argument("--reconvert", action="store_true",
                      help="delete the cached conversion first (to time a first-time set-up)")
    warm.set_defaults(func=_warmup)


def _add_check_parser(sub: argparse._SubParsersAction) -> None:
    from minivllm.check import PIECES

    check = sub.add_parser(
        "check", help="run the engine's tests for one piece on your own class (build_it_yourself/)",
        description="Run the engine's own tests for PIECE with your class in place of the "
                    "engine's; exit status 0 only when all pass. Pieces: " +
                    "; ".join(f"{name}: {p.writes}" for name, p in PIECES.items()))
    check.add_argument("piece", choices=list(PIECES))
    check.add_argument("spec", help="your class: 'path/to/file.py:Class' or 'module:Class', "
                                    "e.g. build_it_yourself/block_pool.py:MyBlockPool")
    check.add_argument("-k", dest="select", default=None, metavar="EXPR",
                       help="only the checks whose names match EXPR (pytest -k), e.g. the one "
                            "that failed")
    check.set_defaults(func=_check)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValidationError as e:  # a bad option: say which, without a traceback
        parser.exit(2, f"minivllm {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
