"""Latency distributions (TTFT, ITL; points below 20 samples) and TTFT split into
queue and prefill time."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from minivllm.metrics import percentile
from minivllm.trace import Trace
from minivllm.viz.style import (
    DECODE_COLOR,
    FEW_SAMPLES,
    LATENCY_SIZE,
    PREFILL_COLOR,
    WAITING_COLOR,
    _new_axes,
    _new_figure,
    _note_time_source,
)

# -- latency and memory ---------------------------------------------------------------


def _percentile_lines(ax: Axes, values_ms: list[float], color: str, name: str,
                      qs: Sequence[int] = (50, 90, 99)) -> None:
    for q, style in zip(qs, ("-", "--", ":")):
        x = percentile(values_ms, q)
        ax.axvline(x, color=color, linestyle=style, linewidth=1.3,
                   label=f"{name} p{q} = {x:.1f} ms", gid=f"{name}:p{q}")


def _strip(ax: Axes, values_ms: list[float], color: str, name: str) -> None:
    """Few samples: every sample as a dot (spread vertically so equal values stay
    visible), and the median; p90 and p99 of a handful of values would only restate the
    largest one."""
    rng = np.random.default_rng(0)  # fixed spread: the same figure every time
    y = rng.uniform(-0.3, 0.3, len(values_ms))
    ax.scatter(values_ms, y, s=28, color=color, alpha=0.8, edgecolors="black", linewidths=0.4,
               label=f"{name}: one dot per sample ({len(values_ms)})", gid=f"{name}:samples")
    _percentile_lines(ax, values_ms, color, name, qs=(50,))
    ax.set_ylim(-1, 1.4)
    ax.set_yticks([])


def plot_latency(trace: Trace, ax: Axes | Sequence[Axes] | None = None) -> Figure:
    """Distributions of time to first token (left) and inter-token latency (right),
    in milliseconds.

    Users feel both: TTFT is how long the screen stays blank, ITL how smoothly text
    streams. Tails matter more than means, which is why serving dashboards (and vLLM's
    benchmarks) report percentiles: with at least :data:`FEW_SAMPLES` samples a panel
    is a histogram with p50 / p90 / p99 marked; with fewer it shows every sample as a
    dot and the median (a p99 of six values is just the largest). Percentiles come from
    :func:`minivllm.metrics.percentile`. Pass two Axes to draw into your own layout, or
    one to overlay both.
    """
    ttfts = [m.ttft * 1e3 for m in trace.requests.values() if m.ttft is not None]
    itls = [x * 1e3 for m in trace.requests.values() for x in m.itls]
    if not ttfts:
        raise ValueError("no request in the trace has a first token yet")
    if ax is None:
        fig = _new_figure(LATENCY_SIZE)
        axes = fig.subplots(1, 2)
    elif isinstance(ax, Axes):
        fig, axes = ax.figure, [ax, ax]
    else:
        axes = list(ax)
        fig = axes[0].figure
    for a, values, name, color in ((axes[0], ttfts, "TTFT", PREFILL_COLOR),
                                   (axes[1], itls, "ITL", DECODE_COLOR)):
        if not values:
            a.text(0.5, 0.5, f"no {name} samples", transform=a.transAxes, ha="center")
            continue
        if len(values) < FEW_SAMPLES:
            _strip(a, values, color, name)
        else:
            a.hist(values, bins=min(30, max(5, len(values) // 2)), color=color, alpha=0.6,
                   label=f"{name} ({len(values)} samples)")
            _percentile_lines(a, values, color, name)
            a.set_ylabel("count")
            a.yaxis.set_major_locator(MaxNLocator(integer=True))  # a count: whole ticks only
        a.set_xlabel("milliseconds")
        # under the panel: a percentile line can fall anywhere across it
        a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    if axes[0] is not axes[1]:
        axes[0].set_title("Time to first token", fontsize=10)
        axes[1].set_title("Inter-token latency", fontsize=10)
        _note_time_source(axes[1], trace.time_source)
    return fig


def plot_ttft_breakdown(trace: Trace, ax: Axes | None = None) -> Figure:
    """Each request's time to first token split in two: time in the queue (arrival to
    first scheduled) and prefill time (first scheduled to first token), in milliseconds.

    The split tells a server what to fix: a long queue wants more capacity (or fewer
    requests admitted), a long prefill wants chunking or prefix caching. The same split
    is in ``get_metrics()`` as ``request_queue_time_seconds`` and
    ``request_prefill_time_seconds`` (notebook 09).
    """
    done = {rid: m for rid, m in trace.requests.items() if m.ttft is not None}
    if not done:
        raise ValueError("no request in the trace has a first token yet")
    fig, ax = _new_axes(ax, (8.0, 0.9 + 0.35 * len(done)))
    order = sorted(done, key=lambda r: done[r].arrival_time)
    for row, rid in enumerate(order):
        m = done[rid]
        queue, prefill = m.queue_time * 1e3, m.prefill_time * 1e3
        ax.barh(row, queue, color=WAITING_COLOR, gid=f"queue:{rid}")
        ax.barh(row, prefill, left=queue, color=PREFILL_COLOR, gid=f"prefill:{rid}")
        ax.text(queue + prefill, row, f" {m.ttft * 1e3:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(order)), labels=order if len(order) <= 40 else None)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlim(0, 1.15 * max(m.ttft for m in done.values()) * 1e3)
    ax.set_xlabel("milliseconds since arrival")
    ax.set_ylabel("request")
    ax.legend(handles=[Patch(facecolor=WAITING_COLOR, label="queue time (waiting for a seat)"),
                       Patch(facecolor=PREFILL_COLOR, label="prefill time (computing the prompt)")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    ax.set_title("Time to first token = queue time + prefill time (label: the TTFT)", fontsize=10)
    _note_time_source(ax, trace.time_source)
    return fig
