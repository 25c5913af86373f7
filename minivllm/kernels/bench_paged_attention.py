"""Benchmark: how close do the paged attention kernels get to the memory bandwidth?

A decode step reads every cached key and value of every sequence once and does little
arithmetic with them, so its speed limit is the GPU's memory bandwidth. This script
times v1 and v2 on decode batches from 1 x 512 to 256 x 4096 (batch x context), counts
the K/V bytes each must read, and reports the achieved GB/s, the fraction of the GPU's
peak where it is known, and the time of PyTorch SDPA on the same data laid out
contiguously (no block table to follow). Times come from CUDA events.

    python -m minivllm.kernels.bench_paged_attention                 # CUDA table
    python -m minivllm.kernels.bench_paged_attention --plot bw.png   # and a figure
    python -m minivllm.kernels.bench_paged_attention --cpu-interpreter

``--cpu-interpreter`` instead times Triton's CPU interpreter on the small shapes the
tests and notebook 05 use, so examples can be sized to run in seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Peak HBM bandwidth in GB/s of some common GPUs, matched by substring of the name.
PEAK_GBPS = {
    "H200": 4800,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "A10G": 600,
    "RTX 4090": 1008,
    "T4": 320,
}
BATCHES = [1, 16, 64, 256]
CONTEXTS = [512, 1024, 2048, 4096]


def make_decode_batch(
    batch: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
) -> dict:
    """A decode batch (one query per sequence) over a paged cache with shuffled blocks."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        query=torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device),
        key_cache=torch.randn(shape, dtype=dtype, device=device),
        value_cache=torch.randn(shape, dtype=dtype, device=device),
        block_tables=torch.randperm(num_blocks, device=device)
        .view(batch, blocks_per_seq)
        .to(torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def cuda_time_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 20) -> float:
    """Median time of ``fn`` in milliseconds, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_gbps(name: str) -> float | None:
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps
    return None


def bench_cuda(args: argparse.Namespace) -> list[dict]:
    from minivllm.kernels.paged_attention_v1 import paged_attention_v1
    from minivllm.kernels.paged_attention_v2 import paged_attention

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps(name)
    print(f"{name}; peak {peak or '?'} GB/s; heads {args.num_heads}/{args.num_kv_heads} kv, "
          f"head_dim {args.head_dim}, block_size {args.block_size}, {args.dtype}")
    header = f"{'batch':>5} {'ctx':>5} {'KV MB':>8} | {'v1 ms':>7} {'GB/s':>6} | {'v2 ms':>7} {'GB/s':>6}"
    header += f" {'%peak':>5} | {'sdpa ms':>7} {'GB/s':>6}"
    print(header)
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            b = make_decode_batch(batch, context, args.num_heads, args.num_kv_heads,
                                  args.head_dim, args.block_size, dtype, "cuda")
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * dtype.itemsize
            v1_ms = cuda_time_ms(lambda b=b: paged_attention_v1(
                b["query"], b["key_cache"], b["value_cache"], b["block_tables"],
                b["seq_lens"], b["scale"]))
            v2_ms = cuda_time_ms(lambda b=b: paged_attention(**b))
            # SDPA on the same keys laid out contiguously: [batch, kv_heads, context, dim]
            k = b["key_cache"][b["block_tables"].long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
            v = b["value_cache"][b["block_tables"].long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
            q = b["query"].unsqueeze(2)
            sdpa_ms = cuda_time_ms(lambda q=q, k=k, v=v, s=b["scale"]: F.scaled_dot_product_attention(
                q, k, v, scale=s, enable_gqa=True))
            del k, v
            row = dict(batch=batch, context=context, kv_bytes=kv_bytes, v1_ms=v1_ms, v2_ms=v2_ms, sdpa_ms=sdpa_ms)
            rows.append(row)
            gbps = {key: kv_bytes / (row[key] * 1e-3) / 1e9 for key in ("v1_ms", "v2_ms", "sdpa_ms")}
            pct = f"{100 * gbps['v2_ms'] / peak:5.0f}" if peak else f"{'?':>5}"
            print(f"{batch:5d} {context:5d} {kv_bytes / 1e6:8.1f} | {v1_ms:7.3f} {gbps['v1_ms']:6.0f} | "
                  f"{v2_ms:7.3f} {gbps['v2_ms']:6.0f} {pct} | {sdpa_ms:7.3f} {gbps['sdpa_ms']:6.0f}")
            del b
    torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: str, peak: float | None) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['batch']}x{r['context']}" for r in rows]
    for key, label in (("v1_ms", "v1 (per query head)"), ("v2_ms", "v2 (GQA tiles)"),
                       ("sdpa_ms", "SDPA, contiguous K/V")):
        ax.plot(labels, [r["kv_bytes"] / (r[key] * 1e-3) / 1e9 for r in rows], marker="o", label=label)
    if peak:
        ax.axhline(peak, color="gray", linestyle="--", label="peak")
    ax.set_xlabel("batch x context")
    ax.set_ylabel("K/V bandwidth (GB/s)")
    ax.tick_params(axis="x", rotation=90)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def bench_interpreter() -> None:
    """Time the CPU interpreter on test-sized shapes (seconds per call, and per program
    instance x loop iteration)."""
    from minivllm.kernels.paged_attention_v1 import _paged_attention_v1_kernel, paged_attention_v1
    from minivllm.kernels.paged_attention_v2 import paged_attention
    from minivllm.kernels.triton_reshape_and_cache import reshape_and_cache

    if "Interpreted" not in type(_paged_attention_v1_kernel).__name__:
        sys.exit("the kernels were imported before TRITON_INTERPRET=1 was set; use a fresh process")

    def seconds(fn: Callable[[], object]) -> float:
        # One call: the interpreter compiles nothing, so there is no warm-up to discard.
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    print("Triton interpreter on this CPU (float32, head_dim 16 unless noted)")
    print(f"{'kernel':<10} {'shape':<48} {'programs x iters':>16} {'seconds':>8} {'ms/unit':>8}")
    # (label, batch, context, heads, kv heads, head_dim, block size)
    decodes = [
        ("4 x 16..64 ctx, GQA 4, bs 16", [1, 16, 35, 64], 8, 2, 16, 16),
        ("8 x 128 ctx, 8 heads, bs 16", [128] * 8, 8, 8, 16, 16),
        ("8 x 512 ctx, 8 heads, d 64, bs 16", [512] * 8, 8, 8, 64, 16),
    ]
    for label, lens, h, hkv, d, bs in decodes:
        b = make_decode_batch(len(lens), max(lens), h, hkv, d, bs, torch.float32, "cpu")
        b["seq_lens"] = torch.tensor(lens, dtype=torch.int32)
        units = h * sum(-(-n // bs) for n in lens)
        t = seconds(lambda b=b: paged_attention_v1(b["query"], b["key_cache"], b["value_cache"],
                                                   b["block_tables"], b["seq_lens"], b["scale"]))
        print(f"{'v1':<10} {'decode ' + label:<48} {units:16d} {t:8.3f} {1e3 * t / units:8.2f}")
        tile_n = max(16, bs)
        units = hkv * sum(-(-n // tile_n) for n in lens)
        t = seconds(lambda b=b: paged_attention(**b))
        print(f"{'v2':<10} {'decode ' + label:<48} {units:16d} {t:8.3f} {1e3 * t / units:8.2f}")

    # A mixed step like the tests': prompt, chunk after context, decodes (GQA 4, bs 16).
    q_lens, seq_lens, bs = [1, 1, 1, 5, 7, 15], [1, 32, 19, 5, 21, 32], 16
    b = make_decode_batch(len(q_lens), 32, 8, 2, 16, bs, torch.float32, "cpu")
    b["query"] = torch.randn(sum(q_lens), 8, 16)
    b["query_start_loc"] = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    b["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int32)
    units = 2 * sum(-(-n // bs) for n in seq_lens)
    t = seconds(lambda: paged_attention(**b))
    print(f"{'v2':<10} {'mixed: 6 seqs, 30 query tokens, GQA 4, bs 16':<48} {units:16d} {t:8.3f} {1e3 * t / units:8.2f}")

    # A long prefill chunk: 40 queries after 10 cached tokens -> 3 query tiles.
    b = make_decode_batch(1, 64, 8, 2, 16, 8, torch.float32, "cpu")
    b["query"] = torch.randn(40, 8, 16)
    b["query_start_loc"] = torch.tensor([0, 40], dtype=torch.int32)
    b["seq_lens"] = torch.tensor([50], dtype=torch.int32)
    units = 2 * (2 + 3 + 4)  # kv heads x (iterations of the 3 tiles up to their causal limits)
    t = seconds(lambda: paged_attention(**b))
    print(f"{'v2':<10} {'chunk: 40 queries after 10 cached, GQA 4, bs 8':<48} {units:16d} {t:8.3f} {1e3 * t / units:8.2f}")

    kc = torch.zeros(16, 16, 2, 64)
    key = torch.randn(32, 2, 64)
    slots = torch.randperm(256)[:32]
    t = seconds(lambda: reshape_and_cache(key, key, kc, kc.clone(), slots))
    print(f"{'store':<10} {'32 tokens x 2 kv heads x 64':<48} {32:16d} {t:8.3f} {1e3 * t / 32:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-interpreter", action="store_true", help="time the CPU interpreter instead")
    parser.add_argument("--plot", metavar="PATH", help="save a bandwidth figure here")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--peak-gbps", type=float, help="the GPU's peak memory bandwidth, if not known")
    args = parser.parse_args()
    if args.cpu_interpreter and os.environ.get("TRITON_INTERPRET") != "1":
        # TRITON_INTERPRET must be set before triton is first imported, and importing
        # minivllm (transformers -> torch._dynamo) already did: start again with it set.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]])

    from minivllm.kernels.triton_utils import triton_available

    if not triton_available():
        print("triton is not installed (it ships Linux wheels only); nothing to benchmark.")
        return
    if args.cpu_interpreter:
        bench_interpreter()
        return
    if not torch.cuda.is_available():
        print("No CUDA device: the bandwidth benchmark needs a GPU. "
              "Try --cpu-interpreter to time the interpreter on small shapes.")
        return
    rows = bench_cuda(args)
    if args.plot:
        plot(rows, args.plot, args.peak_gbps or peak_gbps(torch.cuda.get_device_name()))


if __name__ == "__main__":
    main()
