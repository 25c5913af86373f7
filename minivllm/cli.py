"""The ``minivllm`` command: ``minivllm generate "prompt"``, ``minivllm serve`` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import logging
import sys

from minivllm.exceptions import ValidationError


def _generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams

    llm = LLM(args.model, attention_backend=args.attention_backend, linear_backend=args.linear_backend)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    messages = [{"role": "user", "content": args.prompt}]
    if args.raw:
        pieces = llm.stream(args.prompt, params)
    else:
        pieces = llm.stream(messages, params)
    for piece in pieces:
        print(piece, end="", flush=True)
    print()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from minivllm.server import run_server

    run_server(
        args.host, args.port, api_key=args.api_key, max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes, model=args.model, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, linear_backend=args.linear_backend,
    )
    return 0


def _warmup(args: argparse.Namespace) -> int:
    from minivllm.warmup import warmup

    warmup(args.model, reconvert=args.reconvert, max_tokens=args.max_tokens)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``minivllm`` command's parser (the docs' CLI reference is generated from it)."""
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one answer from the model")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2-135m-instruct")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    gen.add_argument("--linear-backend", default="auto", choices=["auto", "onednn", "torch", "transposed"])
    gen.set_defaults(func=_generate)
    from minivllm.bench.cli import add_arguments as add_bench_arguments
    from minivllm.bench.cli import run as run_bench

    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, memory) and the simulator")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    srv.add_argument("--model", default="smollm2-135m-instruct")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    srv.add_argument("--max-waiting", type=int, default=128,
                     help="refuse new requests (HTTP 503) while this many wait for a seat")
    srv.add_argument("--max-request-bytes", type=int, default=1 << 20,
                     help="refuse request bodies larger than this (HTTP 413; default 1 MiB)")
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--max-num-batched-tokens", type=int, default=512)
    srv.add_argument("--num-kv-blocks", type=int, default=None)
    srv.add_argument("--block-size", type=int, default=16)
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    srv.add_argument("--linear-backend", default="auto", choices=["auto", "onednn", "torch", "transposed"])
    srv.set_defaults(func=_serve)

    warm = sub.add_parser("warmup", help="convert and cache the model before a session; say how long it took")
    warm.add_argument("--model", default="smollm2-135m-instruct")
    warm.add_argument("--max-tokens", type=int, default=16, help="length of the one test generation")
    warm.add_argument("--reconvert", action="store_true",
                      help="delete the cached conversion first (to time a first-time set-up)")
    warm.set_defaults(func=_warmup)
    return parser


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
