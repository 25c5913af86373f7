"""Pictures of the engine, drawn from its step trace (every notebook uses them).

Every function here takes a :class:`~minivllm.trace.Trace` (or plain numbers) and an
optional matplotlib ``Axes``, and returns the ``Figure``. None of them runs the engine:
a figure shows exactly what the trace recorded, so re-running a notebook cell redraws
the same run instead of producing a new one. Figures made here have fixed sizes so they
look the same in every notebook and in ``figures/``.

A request keeps one colour in every picture (:func:`request_color`), so the request
that fills blocks 3, 7 and 9 in the block table is the same colour as its bars in the
batch composition and its row in the timeline; each figure carries the key.

    from minivllm import viz
    fig = viz.plot_batch_composition(llm.trace)
    viz.save_figure(fig, "batch_composition")   # shows, in Jupyter, the file it wrote
    viz.plot_steps(llm.trace)    # a few steps side by side: the static replay
    viz.replay(llm.trace)        # step slider + play button in Jupyter
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from minivllm.metrics import percentile
from minivllm.trace import StepRecord, Trace

FREE_COLOR = "#eeeeee"
"""Face colour of a free block (it may still hold a cached prefix: it is evictable)."""
PREFILL_HATCH = "///"
"""Prefill chunks are hatched; decodes are solid, in the same request colour."""
WAITING_COLOR = "#c8c8c8"
PREFILL_COLOR = "#f28e2b"
DECODE_COLOR = "#4e79a7"
PREEMPTED_COLOR = "#e15759"

BLOCK_TABLE_SIZE = (10.0, 6.0)
BATCH_SIZE = (10.0, 5.5)
TIMELINE_SIZE = (10.0, 5.0)
LATENCY_SIZE = (10.0, 4.0)
KV_USAGE_SIZE = (10.0, 3.5)
MEMORY_WASTE_SIZE = (7.0, 4.5)
REPLAY_SIZE = (14.0, 6.0)
STEPS_SIZE = (14.0, 9.0)
ARCHITECTURE_SIZE = (12.0, 7.2)
FLAT_BATCH_SIZE = (13.0, 6.0)
MAX_KEYED_REQUESTS = 24
"""Figures name every request's colour in a key up to this many requests."""
FEW_SAMPLES = 20
"""Below this many samples a latency figure shows the points, not a histogram."""

_PALETTE = plt.get_cmap("tab20").colors


def request_color(request_id: str) -> tuple[float, float, float]:
    """A stable colour per request id: the same in every figure and every run.

    Numeric ids (what ``LLM.generate`` assigns) walk the palette in order, so the first
    twenty requests get twenty different colours; other ids are hashed (crc32, which,
    unlike Python's ``hash`` of a string, does not change between processes).
    """
    key = int(request_id) if request_id.isdigit() else zlib.crc32(request_id.encode())
    # Even entries of tab20 first (the strong shades), then the light ones.
    return _PALETTE[(2 * key) % 20 + (key // 10) % 2]


def _new_figure(size: tuple[float, float]) -> Figure:
    """A Figure made through pyplot (which switches Jupyter's inline backend on, so the
    Figure renders as a picture) and then closed there at once.

    Closing takes it off pyplot's list of open figures, so Jupyter shows a returned
    figure exactly once (as the cell's result) instead of a second time when pyplot
    flushes its open figures, and replay's redraws are garbage collected rather than
    piling up. The Figure itself still draws and saves normally.
    """
    fig = plt.figure(figsize=size, layout="constrained")
    plt.close(fig)
    return fig


def _new_axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig = _new_figure(size)
    return fig, fig.add_subplot()


def _get_step(trace: Trace, step: int) -> StepRecord:
    if not trace.steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    try:
        return trace.steps[step]
    except IndexError:
        raise IndexError(f"step {step} is out of range: the trace holds {len(trace.steps)} steps") from None


def _request_key(ax: Axes, request_ids: Sequence[str], below: bool = False) -> None:
    """The key from colour to request: beside the axes, or ``below`` it (a note instead
    when there are too many requests to name)."""
    ids = list(dict.fromkeys(request_ids))
    if not ids:
        return
    if len(ids) > MAX_KEYED_REQUESTS:
        ax.text(0.0 if below else 1.01, -0.02 if below else 1.0,
                f"colour = request ({len(ids)} requests)", transform=ax.transAxes, fontsize=7,
                va="top")
        return
    handles = [Patch(facecolor=request_color(r), label=r) for r in ids]
    if below:
        place = dict(loc="upper left", bbox_to_anchor=(0.0, 0.0), ncol=min(len(ids), 12))
    else:
        place = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 if len(ids) <= 12 else 2)
    # An extra legend artist (not ax.legend) so that the axes keeps its own legend slot
    # for the style key (prefill / decode / budget) beside it.
    ax.add_artist(Legend(ax, handles, [h.get_label() for h in handles], title="request (colour)",
                         fontsize=7, title_fontsize=7, handlelength=1.0, borderaxespad=0.0,
                         columnspacing=0.8, **place))


# -- the paged KV cache ---------------------------------------------------------------


def block_owners(record: StepRecord) -> dict[int, list[str]]:
    """Physical block id -> the requests whose block tables list it, after this step."""
    owners: dict[int, list[str]] = {}
    for rid, table in record.block_tables.items():
        for b in table:
            owners.setdefault(b, []).append(rid)
    return owners


def _blocks_shown(trace: Trace, ncols: int) -> int:
    """How many blocks a block-pool picture draws: all of a small pool; of a large one
    (the default 1 GiB cache has over a thousand) the rows up to the highest block any
    step of the trace used, so every frame of a replay shows the same cells."""
    n = trace.num_blocks
    if n <= 256:
        return n
    used = [b for r in trace.steps for t in r.block_tables.values() for b in t]
    highest = max(used, default=0)
    return min(n, max(ncols, math.ceil((highest + 1) / ncols) * ncols))


def plot_block_table(
    trace: Trace, step: int = -1, request_id: str | None = None, ax: Axes | None = None,
    legend: bool = True,
) -> Figure:
    """The KV block pool after one step, and one request's block table drawn out.

    Top: every physical block as a cell, coloured by the request that owns it; free
    blocks are grey. A block listed by several block tables (a shared prefix, through
    prefix caching) is hatched and shows its reference count. Bottom: the chosen
    request's *logical* blocks in order, each with an arrow to the *physical* block that
    holds it. The arrows cross and jump: that is the point of paging. A request's
    tokens need not be contiguous in memory, so any free block can serve any request,
    and nothing has to be reserved in advance (notebook 03).

    ``step`` indexes ``trace.steps`` like a list (-1: the last step). ``request_id``
    defaults to the running request holding the most blocks. A pool of more than 256
    blocks is drawn up to the highest block the run used (the caption says how many
    more, all free). ``legend`` adds the key from colour to request.
    """
    record = _get_step(trace, step)
    fig, ax = _new_axes(ax, BLOCK_TABLE_SIZE)
    n = record.num_blocks
    ncols = min(n, 16)
    shown = _blocks_shown(trace, ncols)
    nrows = math.ceil(shown / ncols)
    owners = block_owners(record)

    for b in range(shown):
        row, col = divmod(b, ncols)
        who = owners.get(b)
        refs = record.block_ref_counts.get(b, len(who) if who else 0)
        face = request_color(who[0]) if who else FREE_COLOR
        rect = Rectangle((col, row), 0.92, 0.92, facecolor=face, edgecolor="#555555",
                         linewidth=0.6, hatch="xx" if refs > 1 else None)
        rect.set_gid(f"block:{b}")
        ax.add_patch(rect)
        label = f"{b}\nref {refs}" if refs > 1 else str(b)
        if shown <= 256:
            ax.text(col + 0.46, row + 0.46, label, ha="center", va="center",
                    fontsize=7 if refs > 1 else 8, color="black" if who is None else "white",
                    fontweight="bold" if refs > 1 else "normal")

    running = record.block_tables
    if request_id is None and running:
        request_id = max(running, key=lambda r: (len(running[r]), -list(running).index(r)))
    map_top = nrows + 0.8
    if request_id is not None and request_id in running:
        table = running[request_id]
        color = request_color(request_id)
        width = min(1.0, ncols / len(table) / 1.1)  # the whole table fits one row
        for i, b in enumerate(table):
            x = i * width * 1.1
            rect = Rectangle((x, map_top), width * 0.92, 0.8, facecolor=color,
                             edgecolor="#333333", linewidth=0.6)
            rect.set_gid(f"logical:{request_id}:{i}")
            ax.add_patch(rect)
            if len(table) <= 32:
                ax.text(x + width * 0.46, map_top + 0.4, f"L{i}", ha="center", va="center",
                        fontsize=7, color="white")
            row, col = divmod(b, ncols)
            ax.annotate("", xy=(col + 0.46, row + 0.92), xytext=(x + width * 0.46, map_top),
                        arrowprops=dict(arrowstyle="->", color=color, lw=0.9, alpha=0.8))
        caption = (f"block table of request {request_id}: logical block Li -> physical block "
                   f"{table if len(table) <= 12 else table[:12] + ['...']}")
    elif request_id is not None:
        caption = f"request {request_id} holds no blocks after this step"
    else:
        caption = "no running request holds blocks after this step"
    if shown < n:
        caption += f"\n(blocks {shown}-{n - 1}, never used in this run, are free and not drawn)"
    ax.text(0, map_top + 1.5, caption, fontsize=9, va="center")

    ax.set_xlim(-0.2, ncols + 0.2)
    ax.set_ylim(map_top + 2.4, -0.3)  # row 0 on top
    ax.set_aspect("equal" if nrows <= 12 else "auto")
    ax.axis("off")
    used = n - record.num_free_blocks
    ax.set_title(f"KV block pool after step {record.step}: {used}/{n} blocks owned "
                 f"({100 * record.kv_cache_usage:.0f}%)\nblock size {trace.block_size}; "
                 f"colour = owning request, grey = free, hatched = shared (ref > 1)", fontsize=10)
    if legend:
        _request_key(ax, list(running), below=True)
    return fig


# -- what each step computed ----------------------------------------------------------


def plot_batch_composition(
    trace: Trace, ax: Axes | Sequence[Axes] | None = None, highlight_step: int | None = None,
    key: bool = True,
) -> Figure:
    """What each step computed: tokens per request (top) and requests in the batch (bottom).

    Top: per step, a stacked bar of the tokens each request contributed. One forward
    pass computes every scheduled token together, prompt chunks and decodes alike; the
    token budget (``max_num_batched_tokens``, the dashed line, or a note when it is far
    above every step) bounds the sum. Prefill chunks are hatched, decodes solid, in the
    request's colour. Bottom: the same steps with one box per scheduled request,
    whatever its token count, so a one-token decode is as visible as a 500-token chunk:
    read batch *membership* there and batch *work* on top. Watch a long prompt arrive:
    with chunked prefill it is cut to fill what the decodes leave of the budget, so the
    decodes keep running in every step (notebooks 04 and 06).

    ``ax``: None for a new figure; two Axes (tokens, requests) to draw into your layout;
    one Axes for the token panel alone. ``highlight_step`` (an index into
    ``trace.steps``) shades one step, for replay; ``key`` names each request's colour.
    """
    if not trace.steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    if ax is None:
        fig = _new_figure(BATCH_SIZE)
        tok_ax, seat_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    elif isinstance(ax, Axes):
        fig, tok_ax, seat_ax = ax.figure, ax, None
    else:
        tok_ax, seat_ax = ax
        fig = tok_ax.figure
    order: list[str] = []
    for record in trace.steps:
        bottom = 0
        for i, c in enumerate(record.scheduled):
            color = request_color(c.request_id)
            hatch = PREFILL_HATCH if c.is_prefill else None
            bar = tok_ax.bar(record.step, c.num_new_tokens, bottom=bottom, width=0.8, color=color,
                             edgecolor="white", linewidth=0.4, hatch=hatch)
            bar.patches[0].set_gid(f"step:{record.step}:{c.request_id}")
            bottom += c.num_new_tokens
            if seat_ax is not None:
                seat = seat_ax.bar(record.step, 1, bottom=i, width=0.8, color=color,
                                   edgecolor="white", linewidth=0.4, hatch=hatch)
                seat.patches[0].set_gid(f"seat:{record.step}:{c.request_id}")
            order.append(c.request_id)
    budget = trace.max_num_batched_tokens
    top = max(r.num_tokens for r in trace.steps)
    handles = [
        Patch(facecolor="#999999", hatch=PREFILL_HATCH, edgecolor="white", label="prefill chunk"),
        Patch(facecolor="#999999", label="decode (1 token)"),
    ]
    title = "Batch composition: tokens each request contributed per step"
    if budget <= 1.5 * top:
        tok_ax.axhline(budget, color="black", linestyle="--", linewidth=1)
        handles.append(Line2D([], [], color="black", linestyle="--", label=f"token budget ({budget})"))
        tok_ax.set_ylim(0, 1.15 * max(top, budget))
    else:  # drawn to scale, the budget line would flatten every bar: say it instead
        tok_ax.set_ylim(0, 1.15 * top)
        title += f"\n(the token budget, {budget} per step, is far above every step here)"
    tok_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  borderaxespad=0.0)
    tok_ax.set_ylabel("tokens in the batch")
    tok_ax.set_title(title, fontsize=10)
    axes = [tok_ax]
    if seat_ax is not None:
        most = max(len(r.scheduled) for r in trace.steps)
        seats = trace.max_num_seqs
        if seats <= 1.5 * most:
            seat_ax.axhline(seats, color="black", linestyle=":", linewidth=1)
            seat_ax.text(0.99, seats, f"max_num_seqs ({seats})", transform=seat_ax.get_yaxis_transform(),
                         ha="right", va="bottom", fontsize=7)
            seat_ax.set_ylim(0, seats + 0.7)
        else:
            seat_ax.set_ylim(0, most + 0.5)
        seat_ax.set_ylabel("requests")
        seat_ax.set_title("Requests in the batch: one box per scheduled request "
                          "(a decode is one box)", fontsize=9)
        seat_ax.yaxis.get_major_locator().set_params(integer=True)
        axes.append(seat_ax)
    if key:
        _request_key(axes[-1], order)
    axes[-1].set_xlabel("engine step")
    if highlight_step is not None:
        s = _get_step(trace, highlight_step).step
        for a in axes:
            a.axvspan(s - 0.5, s + 0.5, color="gold", alpha=0.3, zorder=0)
    return fig


def _step_intervals(trace: Trace) -> dict[int, tuple[float, float]]:
    """Each step's span on the timeline: from its start to the next step's start (the
    engine's bookkeeping between steps belongs to the step before), or to its own end."""
    steps = list(trace.steps)
    out = {}
    for record, nxt in zip(steps, steps[1:] + [None]):
        end = nxt.start if nxt is not None and nxt.start - record.end < 0.5 * record.duration + 1e-3 \
            else record.end
        out[record.step] = (record.start, end)
    return out


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, duration) spans with touching ones joined."""
    merged: list[list[float]] = []
    for start, dur in sorted(spans):
        if merged and start <= merged[-1][0] + merged[-1][1] + 1e-9:
            merged[-1][1] = max(merged[-1][1], start + dur - merged[-1][0])
        else:
            merged.append([start, dur])
    return [(a, b) for a, b in merged]


def request_spans(trace: Trace) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """For each request, its (start, duration) spans by phase: "waiting", "prefill",
    "decode" and "preempted". Times are the engine clock's, from the step records; a
    request scheduled in consecutive steps gets one span across them (the engine's
    work between two steps is part of serving it)."""
    spans = {rid: {"waiting": [], "prefill": [], "decode": [], "preempted": []}
             for rid in trace.requests}
    interval = _step_intervals(trace)
    preempted_at: dict[str, float] = {}
    for record in trace.steps:
        start, end = interval[record.step]
        for c in record.scheduled:
            if c.request_id not in spans:
                continue
            if c.request_id in preempted_at:
                t = preempted_at.pop(c.request_id)
                spans[c.request_id]["preempted"].append((t, record.start - t))
            kind = "prefill" if c.is_prefill else "decode"
            spans[c.request_id][kind].append((start, end - start))
        for rid in record.preempted:
            preempted_at[rid] = record.end
    for rid, m in trace.requests.items():
        if m.first_scheduled_time is not None:
            spans[rid]["waiting"].append((m.arrival_time, m.first_scheduled_time - m.arrival_time))
        if rid in preempted_at:  # preempted and never rescheduled (aborted, or still waiting)
            end = m.finished_time if m.finished_time is not None else preempted_at[rid]
            spans[rid]["preempted"].append((preempted_at[rid], end - preempted_at[rid]))
    return {rid: {k: _merge(v) for k, v in kinds.items()} for rid, kinds in spans.items()}


def plot_request_timeline(trace: Trace, ax: Axes | None = None) -> Figure:
    """One row per request: waiting (grey), prefill (orange), decode (blue) and
    preempted (red) spans, a tick at every output token, a dot at its arrival.

    Read a request's latencies off its row: queue time is the grey bar, time to first
    token runs from its arrival dot to the first tick, and the tick spacing is the
    inter-token latency. A red span is time lost to preemption: the request's blocks were
    taken, and it waits to recompute them (notebook 08). Time is seconds since the first
    arrival. The arrival dot has the request's colour (the one it has in every figure).
    """
    if not trace.requests:
        raise ValueError("the trace has no requests yet: run the engine first")
    fig, ax = _new_axes(ax, TIMELINE_SIZE)
    order = sorted(trace.requests, key=lambda r: trace.requests[r].arrival_time)
    t0 = min(m.arrival_time for m in trace.requests.values())
    spans = request_spans(trace)
    colors = {"waiting": WAITING_COLOR, "prefill": PREFILL_COLOR, "decode": DECODE_COLOR,
              "preempted": PREEMPTED_COLOR}
    for row, rid in enumerate(order):
        for kind, color in colors.items():
            bars = [(s - t0, d) for s, d in spans[rid][kind]]
            if bars:
                coll = ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=color, edgecolors="none",
                                      hatch="xx" if kind == "preempted" else None)
                coll.set_gid(f"{kind}:{rid}")
        m = trace.requests[rid]
        if m.token_times:
            ax.plot([t - t0 for t in m.token_times], [row] * len(m.token_times), "|",
                    color="black", markersize=9, gid=f"tokens:{rid}")
        ax.plot([m.arrival_time - t0], [row], marker="o", color=request_color(rid), markersize=5,
                markeredgecolor="black", markeredgewidth=0.5, gid=f"arrival:{rid}")
    ax.set_yticks(range(len(order)), labels=order if len(order) <= 40 else None)
    if len(order) > 40:
        ax.set_yticks([])
    ax.set_ylim(len(order) - 0.5, -0.5)  # first arrival on top
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("request")
    handles = [Patch(facecolor=c, label=k, hatch="xx" if k == "preempted" else None)
               for k, c in colors.items()]
    handles.append(Line2D([], [], color="black", marker="|", linestyle="", markersize=9,
                          label="output token"))
    handles.append(Line2D([], [], color="#999999", marker="o", linestyle="", markersize=5,
                          markeredgecolor="black", markeredgewidth=0.5,
                          label="arrival (request colour)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title("Request timeline: waiting, prefill, decode and preempted time", fontsize=10)
    return fig


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
        a.set_xlabel("milliseconds")
        a.legend(fontsize=8, loc="upper right")
    if axes[0] is not axes[1]:
        axes[0].set_title("Time to first token", fontsize=10)
        axes[1].set_title("Inter-token latency", fontsize=10)
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
    return fig


def plot_kv_usage(trace: Trace, ax: Axes | None = None) -> Figure:
    """KV cache usage (% of blocks owned) after each step, with preemptions marked.

    Usage climbs as prompts are admitted and each decode fills its last block; it
    drops as requests finish. When a running request needs a block and none is free,
    the scheduler preempts the most recently admitted request (red marks): its blocks
    are freed and it recomputes later (notebook 08).
    """
    if not trace.steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    fig, ax = _new_axes(ax, KV_USAGE_SIZE)
    steps = [r.step for r in trace.steps]
    usage = [100 * r.kv_cache_usage for r in trace.steps]
    ax.plot(steps, usage, color=DECODE_COLOR, linewidth=1.5, label="KV cache usage", gid="usage")
    ax.fill_between(steps, usage, color=DECODE_COLOR, alpha=0.15)
    pre = [(r.step, 100 * r.kv_cache_usage, len(r.preempted)) for r in trace.steps if r.preempted]
    if pre:
        ax.scatter([p[0] for p in pre], [p[1] for p in pre], marker="v", color=PREEMPTED_COLOR,
                   s=[30 + 20 * p[2] for p in pre], zorder=3, gid="preemptions",
                   label=f"preemption ({sum(p[2] for p in pre)} in all)")
    ax.set_ylim(0, 105)
    ax.set_xlabel("engine step")
    ax.set_ylabel("% of KV blocks owned")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"KV cache usage ({trace.num_blocks} blocks of {trace.block_size} tokens)",
                 fontsize=10)
    return fig


def memory_waste(
    prompt_lens: Sequence[int], output_lens: Sequence[int], block_size: int, max_model_len: int
) -> dict[str, int]:
    """KV slots (tokens) that three policies hold for the same requests at their largest.

    - ``contiguous``: reserve ``max_model_len`` slots per request up front, as systems
      before vLLM did, because the output length is unknown in advance;
    - ``paged``: whole blocks, only as the request grows: ``ceil(tokens / block_size)``
      blocks, wasting less than one block per request;
    - ``stored``: the tokens actually there (prompt plus output).
    """
    from minivllm.bench.memory import kv_slots_held  # the arithmetic, shared with `bench memory`

    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(output_lens)} output lengths")
    return kv_slots_held([p + o for p, o in zip(prompt_lens, output_lens)], block_size, max_model_len)


def plot_memory_waste(
    prompt_lens: Sequence[int] | Trace,
    output_lens: Sequence[int] | None = None,
    block_size: int | None = None,
    max_model_len: int = 2048,
    ax: Axes | None = None,
) -> Figure:
    """KV memory held by a contiguous max-length reservation, by paged blocks, and by
    the tokens actually stored, for one workload (notebook 03).

    This is the picture behind the PagedAttention paper: reserving for the longest
    possible sequence leaves most of the cache empty but unusable, so fewer requests fit
    and the batch stays small. Paging wastes at most part of one block per request.
    Pass lengths, or a trace (its requests' prompt and output lengths and block size).
    """
    if isinstance(prompt_lens, Trace):
        trace = prompt_lens
        block_size = block_size or trace.block_size
        prompt_lens = [m.num_prompt_tokens for m in trace.requests.values()]
        output_lens = [len(m.token_times) for m in trace.requests.values()]
    if output_lens is None:
        raise ValueError("pass output_lens with prompt_lens (or pass a trace)")
    block_size = block_size or 16
    held = memory_waste(prompt_lens, output_lens, block_size, max_model_len)
    fig, ax = _new_axes(ax, MEMORY_WASTE_SIZE)
    labels = [f"contiguous\n(max_model_len={max_model_len})", f"paged\n(block_size={block_size})",
              "tokens stored"]
    values = [held["contiguous"], held["paged"], held["stored"]]
    bars = ax.bar(labels, values, color=[PREEMPTED_COLOR, DECODE_COLOR, "#59a14f"])
    for bar, v in zip(bars[:2], values[:2]):
        waste = 1 - held["stored"] / v if v else 0.0
        ax.annotate(f"{v:,} slots\n{100 * waste:.0f}% unused", (bar.get_x() + bar.get_width() / 2, v),
                    ha="center", va="bottom", fontsize=8)
    ax.annotate(f"{values[2]:,} tokens", (bars[2].get_x() + bars[2].get_width() / 2, values[2]),
                ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(values) * 1.2 or 1)
    ax.set_ylabel("KV cache slots (tokens)")
    ax.set_title(f"KV memory for {len(prompt_lens)} requests", fontsize=10)
    return fig


# -- a few steps side by side, and the interactive replay -------------------------------


def pick_steps(trace: Trace, k: int = 4) -> list[int]:
    """Up to ``k`` steps worth a look (indices into ``trace.steps``), in time order. In
    order of preference: the first, the first preemption, the first step a request
    finished in, the fullest KV cache, the most requests, the middle one, the last."""
    steps = list(trace.steps)
    if not steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    index = range(len(steps))
    candidates = [0]
    candidates += [i for i in index if steps[i].preempted][:1]
    candidates += [i for i in index if steps[i].finished][:1]
    candidates.append(max(index, key=lambda i: (steps[i].kv_cache_usage, -i)))
    candidates.append(max(index, key=lambda i: (len(steps[i].scheduled), -i)))
    candidates += [len(steps) // 2, len(steps) - 1]
    return sorted(list(dict.fromkeys(candidates))[:k])  # the first k distinct, in time order


def plot_steps(trace: Trace, steps: Sequence[int] | None = None,
               request_id: str | Sequence[str | None] | None = None) -> Figure:
    """The replay as one static picture: the batch composition with a few steps
    lettered (top), and the block pool after each of those steps (bottom).

    What :func:`replay` animates, for readers of a stored notebook or a web page where
    no widget runs. ``steps`` are indices into ``trace.steps`` (default
    :func:`pick_steps`); ``request_id`` is the request whose block table is drawn out, one
    for all steps or one per step (default: the one holding the most blocks at each step).
    """
    chosen = list(steps) if steps is not None else pick_steps(trace)
    if not chosen:
        raise ValueError("choose at least one step")
    if request_id is None or isinstance(request_id, str):
        request_ids = [request_id] * len(chosen)
    else:
        request_ids = list(request_id)
        if len(request_ids) != len(chosen):
            raise ValueError(f"{len(request_ids)} request ids for {len(chosen)} steps")
    records = [_get_step(trace, i) for i in chosen]
    ncols = min(trace.num_blocks, 16)
    pool_rows = math.ceil(_blocks_shown(trace, ncols) / ncols) + 2.8
    grid_rows = math.ceil(len(chosen) / 2)
    pool_h = min(4.0, 0.43 * pool_rows * 16 / ncols) + 0.6  # inches, a pool panel 7 in wide
    fig = _new_figure((STEPS_SIZE[0], 4.6 + grid_rows * pool_h))
    grid = fig.add_gridspec(2 + grid_rows, 2, height_ratios=[1.3, 0.7] + [pool_h / 2.3] * grid_rows)
    tok_ax = fig.add_subplot(grid[0, :])
    seat_ax = fig.add_subplot(grid[1, :], sharex=tok_ax)
    plot_batch_composition(trace, ax=(tok_ax, seat_ax))
    for letter, record in zip("ABCDEFGH", records):
        for a in (tok_ax, seat_ax):
            a.axvspan(record.step - 0.5, record.step + 0.5, color="gold", alpha=0.35, zorder=0)
        tok_ax.annotate(letter, (record.step, tok_ax.get_ylim()[1]), ha="center", va="top",
                        fontsize=10, fontweight="bold")
    for j, (letter, i, record) in enumerate(zip("ABCDEFGH", chosen, records)):
        pool_ax = fig.add_subplot(grid[2 + j // 2, j % 2])
        plot_block_table(trace, i, request_ids[j], ax=pool_ax, legend=False)
        parts = [f"{c.request_id}:{'P' if c.is_prefill else 'D'}{c.num_new_tokens}"
                 for c in record.scheduled[:8]]
        more = " ..." if len(record.scheduled) > 8 else ""
        pool_ax.set_title(f"{letter}: KV block pool after step {record.step} "
                          f"({record.num_free_blocks}/{record.num_blocks} blocks free); this step ran "
                          + " ".join(parts) + more, fontsize=8)
    fig.suptitle("Steps side by side (gold, lettered): what ran in each step, and the KV block "
                 "pool after it. P = prefill tokens, D = decode", fontsize=10)
    return fig


def _replay_figure(trace: Trace, step: int, request_id: str | None = None) -> Figure:
    fig = _new_figure(REPLAY_SIZE)
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 1.2], height_ratios=[2, 1])
    left = fig.add_subplot(grid[:, 0])
    tok_ax = fig.add_subplot(grid[0, 1])
    seat_ax = fig.add_subplot(grid[1, 1], sharex=tok_ax)
    plot_block_table(trace, step, request_id, ax=left)
    plot_batch_composition(trace, ax=(tok_ax, seat_ax), highlight_step=step)
    record = trace.steps[step]
    parts = [f"{c.request_id}: {'prefill' if c.is_prefill else 'decode'} {c.num_new_tokens}"
             for c in record.scheduled[:8]]
    more = f" (+{len(record.scheduled) - 8} more)" if len(record.scheduled) > 8 else ""
    fig.suptitle(f"step {record.step} (gold): " + ", ".join(parts) + more, fontsize=10)
    return fig


def _has_widget_frontend() -> bool:
    """True inside a Jupyter kernel (where ipywidgets can render), False in plain Python."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def replay(trace: Trace, request_id: str | None = None):
    """Step through a run: a slider and a Play button redraw the block table and the
    batch composition at each step.

    In Jupyter this returns an ipywidgets box: leave it as the cell's last line (no
    trailing ``;``, which would hide it) or ``display()`` it. Without a widget front end
    (plain Python, a script) it draws the first step statically and returns that Figure.
    A stored notebook viewed without a kernel may not render widgets: put
    :func:`plot_steps` beside the replay, so the steps are there as a picture too.
    """
    if not trace.steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    if not _has_widget_frontend():
        return _replay_figure(trace, 0, request_id)

    import ipywidgets as widgets
    from IPython.display import display

    last = len(trace.steps) - 1
    play = widgets.Play(value=0, min=0, max=last, step=1, interval=500, description="Play")
    slider = widgets.IntSlider(value=0, min=0, max=last, description="step",
                               continuous_update=False)
    widgets.jslink((play, "value"), (slider, "value"))
    out = widgets.Output()

    def draw(index: int) -> None:
        with out:
            out.clear_output(wait=True)
            fig = _replay_figure(trace, index, request_id)
            display(fig)

    slider.observe(lambda change: draw(change["new"]), names="value")
    draw(0)
    return widgets.VBox([widgets.HBox([play, slider]), out])


# -- the engine's parts, and the flat batch the model runner builds ------------------------

# (label, module(s), notebooks, x, y): the boxes of plot_architecture.
_ARCHITECTURE = {
    "llm": ("LLM: generate / chat / stream\n(the offline API)", "minivllm/llm.py", "00", 2.0, 7.0),
    "server": ("API server (OpenAI HTTP), and\nAsyncLLMEngine: one stepping thread",
               "minivllm/server.py\nminivllm/async_engine.py", "10", 2.0, 4.8),
    "detokenizer": ("Detokenizer: tokens -> text\nstop strings, streamed pieces",
                    "minivllm/detokenizer.py", "00 10", 2.0, 2.6),
    "engine": ("Engine core: LLMEngine.step()\nschedule, run, update, outputs",
               "minivllm/engine.py", "04 09", 6.6, 7.0),
    "scheduler": ("Scheduler: who runs this step\ntoken budget, chunks, preemption",
                  "minivllm/core/scheduler.py", "04 06 08", 11.2, 7.0),
    "kv": ("KV cache manager + block pool\nblock tables, free queue, prefix hashes",
           "minivllm/core/kv_cache_manager.py\nminivllm/core/block_pool.py", "03 07", 11.2, 4.8),
    "runner": ("Model runner: one flat batch\ninput_ids, positions, slot_mapping",
               "minivllm/model_runner.py", "04 05", 6.6, 4.8),
    "attention": ("Model (transformers), its attention:\nthe paged attention kernel",
                  "minivllm/attention.py\nkernels/ (reference, Triton)", "05", 6.6, 2.6),
    "sampler": ("Sampler: logits -> next token\ngreedy, temperature, top-k/p",
                "minivllm/sampler.py", "00", 6.6, 0.4),
}
# (from, to, label, arc): the arrows, in the order one request travels.
_ARCHITECTURE_FLOW = [
    ("llm", "engine", "add_request", 0.0), ("server", "engine", "add_request", 0.0),
    ("engine", "scheduler", "1 schedule()", 0.0), ("scheduler", "kv", "allocate / free blocks", 0.0),
    ("engine", "runner", "2 execute", 0.0), ("runner", "attention", "forward", 0.0),
    ("attention", "sampler", "logits", 0.0), ("sampler", "engine", "3 new tokens", 0.2),
    ("engine", "detokenizer", "4 text", 0.0), ("detokenizer", "server", "stream", 0.0),
    ("detokenizer", "llm", "RequestOutput", -0.2),
]


def plot_architecture(ax: Axes | None = None) -> Figure:
    """The engine's parts and the path one request takes through them, each box naming
    the module that implements it and the notebooks that teach it (notebook 00).

    A request enters through the offline ``LLM`` or the HTTP server, the engine core
    runs steps: the scheduler picks this step's tokens (and asks the KV cache manager
    for blocks), the model runner packs them into one flat batch for the model, whose
    attention reads and writes the paged cache, the sampler picks each next token, and
    the detokenizer turns tokens into text for the caller. The same picture as vLLM's
    V1 engine, with vLLM's names.
    """
    fig, ax = _new_axes(ax, ARCHITECTURE_SIZE)
    w, h = 3.3, 1.3
    centres = {}
    for key, (label, module, notebooks, x, y) in _ARCHITECTURE.items():
        box = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05",
                             facecolor="#f4f1e8", edgecolor="#555555", linewidth=1.0)
        box.set_gid(f"box:{key}")
        ax.add_patch(box)
        ax.text(x, y + 0.22, label, ha="center", va="center", fontsize=8.5, fontweight="bold")
        ax.text(x, y - 0.37, module, ha="center", va="center", fontsize=7.5, family="monospace",
                color="#1f4e79")
        ax.text(x + w / 2 - 0.05, y + h / 2 - 0.05, f"nb {notebooks}", ha="right", va="top",
                fontsize=6.5, color="#777777")
        centres[key] = (x, y)
    for a, b, label, arc in _ARCHITECTURE_FLOW:
        (x0, y0), (x1, y1) = centres[a], centres[b]
        if arc:  # around the side of the boxes in between: leave and enter sideways
            side = (w / 2 + 0.05) * (1 if arc > 0 else -1)
            start, end = (x0 + side, y0), (x1 + side, y1 - 0.3)
            # a quadratic curve bulges by half its control point's offset, rad x length
            mid = (start[0] + 0.5 * arc * abs(end[1] - start[1]), (start[1] + end[1]) / 2)
        else:  # leave and enter each box through its edge, not its centre
            dx, dy = x1 - x0, y1 - y0
            scale = min(abs((w / 2 + 0.1) / dx) if dx else math.inf,
                        abs((h / 2 + 0.1) / dy) if dy else math.inf)
            start = (x0 + dx * scale, y0 + dy * scale)
            end = (x1 - dx * scale, y1 - dy * scale)
            mid = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        arrow = ax.annotate("", xy=end, xytext=start,
                            arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.1,
                                            connectionstyle=f"arc3,rad={arc}"))
        arrow.set_gid(f"flow:{a}->{b}")
        ax.text(*mid, label, ha="center", va="center", fontsize=7.5, color="#8b2f00",
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=0.5))
    ax.set_xlim(-1.2, 13.3)
    ax.set_ylim(-0.5, 7.9)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("minivllm, one engine step: the parts, their modules (blue), the notebooks "
                 "that teach them (nb), and the numbered path of a step", fontsize=10)
    return fig


def plot_flat_batch(
    input_ids: Sequence[int],
    positions: Sequence[int],
    slot_mapping: Sequence[int],
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    request_ids: Sequence[str],
    block_size: int,
    logits_indices: Sequence[int] = (),
    ax: Axes | None = None,
) -> Figure:
    """The model runner's input for one step, drawn: what attention receives.

    Top: one column per token of the flat batch, every scheduled request's new tokens
    end to end (no padding), with its ``input_ids``, its ``positions`` in its own
    sequence and its ``slot_mapping`` (the cache slot its K/V are written to:
    ``block_table[position // block_size] * block_size + position % block_size``).
    Thick lines are the ``query_start_loc`` boundaries; dashed ones mark where a request's
    positions enter a new cache block; stars mark ``logits_indices``, the tokens whose
    logits are computed (the last of each request that samples).
    Bottom: per sequence, ``seq_lens`` (tokens in the cache after the step) and the block
    table (padded with 0 to the longest; only the first ``ceil(seq_len / block_size)``
    entries are real). Pass plain sequences or tensors, e.g. from
    ``ModelRunner.prepare_inputs`` (notebook 04).
    """
    def ints(x):
        return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]

    ids, pos, slots = ints(input_ids), ints(positions), ints(slot_mapping)
    qsl, lens = ints(query_start_loc), ints(seq_lens)
    tables = [ints(t) for t in (block_tables.tolist() if hasattr(block_tables, "tolist") else block_tables)]
    logits = set(ints(logits_indices))
    n, nseq = len(ids), len(lens)
    if not (len(pos) == len(slots) == n == qsl[-1]) or len(qsl) != nseq + 1 or len(request_ids) != nseq:
        raise ValueError("inconsistent flat batch: input_ids, positions, slot_mapping and "
                         "query_start_loc[-1] must agree, with one request id per sequence")
    fig, ax = _new_axes(ax, FLAT_BATCH_SIZE)
    owner = [s for s in range(nseq) for _ in range(qsl[s], qsl[s + 1])]
    rows = [("input_ids", ids), ("positions", pos), ("slot_mapping", slots)]
    fs = 7 if n <= 24 else 5.5 if n <= 48 else 4
    for r, (name, values) in enumerate(rows):
        ax.text(-0.3, r + 0.5, name, ha="right", va="center", fontsize=8, family="monospace")
        for t, v in enumerate(values):
            color = request_color(request_ids[owner[t]])
            cell = Rectangle((t, r), 0.95, 0.95, facecolor=color, alpha=0.35, edgecolor="#555555",
                             linewidth=0.4)
            cell.set_gid(f"{name}:{t}")
            ax.add_patch(cell)
            ax.text(t + 0.47, r + 0.48, str(v), ha="center", va="center", fontsize=fs,
                    rotation=90 if name == "input_ids" and n > 24 else 0)
    ax.text(-0.3, 3.35, "token index", ha="right", va="center", fontsize=7, color="#777777")
    for t in range(n):
        if n <= 48 or t % 5 == 0:
            ax.text(t + 0.47, 3.35, str(t), ha="center", va="center", fontsize=fs, color="#777777")
        if t in logits:
            ax.plot(t + 0.47, 3.8, marker="*", color="black", markersize=8, gid=f"logits:{t}")
    for s in range(nseq + 1):
        ax.plot([qsl[s], qsl[s]], [-0.2, 3.1], color="black", linewidth=2.2, gid=f"qsl:{s}")
        ax.text(qsl[s], -0.35, str(qsl[s]), ha="center", va="bottom", fontsize=7, fontweight="bold")
    ax.text(-0.3, -0.3, "query_start_loc", ha="right", va="bottom", fontsize=8, family="monospace")
    # where a sequence's positions enter a new cache block (its slots may jump anywhere)
    for t in range(n):
        if t != qsl[owner[t]] and pos[t] % block_size == 0:
            ax.plot([t - 0.025, t - 0.025], [2.0, 3.0], color="black", linestyle="--", linewidth=1.2,
                    gid=f"new_block:{t}")
    # the sequences, under the batch: a line of text, then the block table
    y0 = 4.6
    ax.text(-0.3, y0, "per sequence:", ha="right", va="center", fontsize=8)
    for s in range(nseq):
        y = y0 + 2.0 * s
        q_len = qsl[s + 1] - qsl[s]
        kind = "decode" if q_len == 1 and lens[s] > 1 else \
            "prefill" if q_len == lens[s] else "prefill chunk"
        real = math.ceil(lens[s] / block_size)
        ax.text(0, y, f"request {request_ids[s]}: {kind}, {q_len} new token(s) at positions "
                      f"{pos[qsl[s]]}-{pos[qsl[s + 1] - 1]}, seq_lens = {lens[s]}; its block table "
                      f"(block i holds positions {block_size}i to {block_size}i+{block_size - 1}):",
                fontsize=8, va="center")
        for j, b in enumerate(tables[s]):
            cell = Rectangle((0.9 * j, y + 0.45), 0.85, 0.8,
                             facecolor=request_color(request_ids[s]) if j < real else "white",
                             edgecolor="#555555", linewidth=0.5, alpha=0.8 if j < real else 1.0)
            cell.set_gid(f"table:{s}:{j}")
            ax.add_patch(cell)
            ax.text(0.9 * j + 0.42, y + 0.85, str(b), ha="center", va="center", fontsize=7,
                    color="white" if j < real else "#999999")
    width = max(map(len, tables), default=0)
    ax.set_xlim(-7.5, max(n, 0.9 * width, 24) + 0.5)
    ax.set_ylim(y0 + 2.0 * nseq, -0.8)
    ax.axis("off")
    handles = [Patch(facecolor=request_color(r), alpha=0.5, label=f"request {r}") for r in request_ids]
    handles.append(Line2D([], [], color="black", marker="*", linestyle="", label="logits computed"))
    handles.append(Line2D([], [], color="black", linestyle="--", label="a new cache block begins"))
    handles.append(Patch(facecolor="white", edgecolor="#555555", label="block table padding"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(f"One step's flat batch: {n} tokens of {nseq} requests, block size {block_size}",
                 fontsize=10)
    return fig


# -- saving ---------------------------------------------------------------------------

FIGURES_ENV = "MINIVLLM_FIGURES_DIR"
"""Environment variable naming another folder for :func:`save_figure` (the test suite
points it at a temporary folder, so that running the notebooks under test does not
rewrite the committed figures)."""


def figures_dir() -> Path:
    """``$MINIVLLM_FIGURES_DIR`` when set; else the repository's ``figures/`` folder when
    running from a checkout, else ``./figures`` (created if missing)."""
    if os.environ.get(FIGURES_ENV):
        folder = Path(os.environ[FIGURES_ENV])
    else:
        repo_figures = Path(__file__).resolve().parents[1] / "figures"
        folder = repo_figures if repo_figures.is_dir() else Path.cwd() / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class SavedFigure(os.PathLike):
    """The path of a figure written by :func:`save_figure`, which Jupyter displays as
    the picture in that file: what a notebook shows is byte for byte what it saved."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        # The folder and the name, not the absolute path: notebooks store this text.
        return f"<figure saved to {self.path.parent.name}/{self.path.name}>"

    def __eq__(self, other: object) -> bool:
        return self.path == Path(other) if isinstance(other, (str, os.PathLike)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.path)

    def _repr_png_(self) -> bytes | None:
        return self.path.read_bytes() if self.path.suffix.lower() == ".png" else None

    def _repr_svg_(self) -> str | None:
        return self.path.read_text() if self.path.suffix.lower() == ".svg" else None


def save_figure(fig: Figure, name: str, dpi: int = 120) -> SavedFigure:
    """Write ``fig`` to ``figures/<name>`` (PNG unless ``name`` ends in .svg or .pdf)
    and return its path, as a :class:`SavedFigure`: the last line of a notebook cell,
    it shows the file just written, so the committed figure and the stored notebook
    output are the same picture."""
    path = figures_dir() / name
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        path = path.with_name(path.name + ".png")
    # A fixed date stamp: the same figure gives the same bytes, run after run.
    metadata = {"Software": None} if path.suffix.lower() == ".png" else None
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata=metadata)
    return SavedFigure(path)
