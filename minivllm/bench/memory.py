"""Memory mode: the KV cache a workload needs, paged against a contiguous reservation.

``minivllm bench memory`` (notebook 03). Pure arithmetic on the workload, no model:
every request at its full length (prompt plus ``max_tokens``), held either as a
contiguous ``max_model_len`` reservation, as systems before vLLM did because the output
length is unknown in advance, or as whole blocks taken only as the request grows.
:func:`kv_slots_held` is that arithmetic; ``viz.memory_waste`` draws from it too.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from minivllm.bench.common import load_tokenizer, save_figure
from minivllm.sim.workload import WorkloadRequest, chat_workload


def kv_slots_held(lengths: Sequence[int], block_size: int, max_model_len: int) -> dict[str, int]:
    """KV slots (tokens) held for requests of these full ``lengths``, three ways:

    - ``contiguous``: ``max_model_len`` slots per request, reserved up front;
    - ``paged``: ``ceil(length / block_size)`` whole blocks per request: only the last
      block is partly empty, so the waste is less than one block per request;
    - ``stored``: the tokens actually there.
    """
    return {
        "contiguous": max_model_len * len(lengths),
        "paged": sum(-(-n // block_size) * block_size for n in lengths),
        "stored": sum(lengths),
    }


def _requests_that_fit_paged(lengths: Sequence[int], block_size: int, num_blocks: int) -> int:
    """Requests admitted in workload order, cycling, until the next one's blocks run out."""
    fit, i = 0, 0
    while True:
        need = -(-lengths[i % len(lengths)] // block_size)
        if need > num_blocks:
            return fit
        num_blocks -= need
        fit += 1
        i += 1


def kv_memory_report(
    workload: Sequence[WorkloadRequest],
    block_size: int = 16,
    max_model_len: int = 2048,
    kv_bytes_per_token: int = 46080,
    kv_cache_memory: int = 1 << 30,
) -> dict[str, float]:
    """KV cache ``workload`` needs paged and contiguous (:func:`kv_slots_held`), and how
    many of its requests fit at once in ``kv_cache_memory`` bytes each way.
    ``kv_bytes_per_token`` defaults to SmolLM2-135M in float32 (30 layers x 3 KV heads x
    64 dims x K and V x 4 bytes)."""
    lengths = [r.num_prompt_tokens + r.max_tokens for r in workload]
    if not lengths:
        raise ValueError("the workload is empty")
    too_long = [n for n in lengths if n > max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests are longer than max_model_len {max_model_len}")
    held = kv_slots_held(lengths, block_size, max_model_len)
    used, paged, contiguous = held["stored"], held["paged"], held["contiguous"]
    capacity = kv_cache_memory // kv_bytes_per_token
    return {
        "num_requests": len(lengths),
        "tokens_used": used,
        "paged_slots": paged,
        "contiguous_slots": contiguous,
        "paged_waste": 1 - used / paged,
        "contiguous_waste": 1 - used / contiguous,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_cache_memory": kv_cache_memory,
        "capacity_tokens": capacity,
        "fit_contiguous": capacity // max_model_len,
        "fit_paged": _requests_that_fit_paged(lengths, block_size, capacity // block_size),
    }


def format_memory_report(m: dict) -> str:
    mib = m["kv_bytes_per_token"] / 2**20
    return "\n".join([
        f"{m['num_requests']} requests, {m['tokens_used']} tokens of KV at full length "
        f"({m['tokens_used'] * mib:.0f} MiB)",
        f"contiguous ({m['max_model_len']} slots each): {m['contiguous_slots']} slots, "
        f"{m['contiguous_slots'] * mib:.0f} MiB, {m['contiguous_waste']:.1%} wasted",
        f"paged (blocks of {m['block_size']}):       {m['paged_slots']} slots, "
        f"{m['paged_slots'] * mib:.0f} MiB, {m['paged_waste']:.1%} wasted",
        f"in {m['kv_cache_memory'] / 2**20:.0f} MiB ({m['capacity_tokens']} tokens): "
        f"{m['fit_contiguous']} requests fit contiguous, {m['fit_paged']} paged "
        f"({m['fit_paged'] / max(m['fit_contiguous'], 1):.1f}x)",
    ])


def plot_memory(m: dict, ax=None):
    """Stacked bars: KV slots used and wasted, contiguous against paged."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 2.6))
    else:
        fig = ax.figure
    mib = m["kv_bytes_per_token"] / 2**20
    used = m["tokens_used"] * mib
    labels = [f"contiguous ({m['max_model_len']} each)", f"paged (block {m['block_size']})"]
    totals = [m["contiguous_slots"] * mib, m["paged_slots"] * mib]
    ax.barh(labels, [used, used], color="tab:green", label="holds a token")
    ax.barh(labels, [t - used for t in totals], left=[used, used], color="tab:red", alpha=0.6,
            label="reserved, empty")
    for y, t in enumerate(totals):
        ax.text(t, y, f" {t:.0f} MiB ({1 - used / t:.0%} waste)", va="center", fontsize=8)
    ax.set_xlim(0, max(totals) * 1.4)
    ax.set_xlabel(f"KV cache for {m['num_requests']} requests (MiB)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def main(args: argparse.Namespace) -> int:
    """``minivllm bench memory``: the chat workload's KV cache, by arithmetic."""
    tok = load_tokenizer(args.model)
    workload = chat_workload(tok, args.num_requests or 32, args.seed)
    m = kv_memory_report(workload, args.block_size, args.max_model_len)
    print(format_memory_report(m))
    save_figure(plot_memory(m), args.figures, "bench_memory.png")
    return 0
