"""Pictures of the engine, drawn from its step trace (notebooks 03, 04, 06, 07, 08, 09).

Every function here takes a :class:`~minivllm.trace.Trace` (or plain numbers) and an
optional matplotlib ``Axes``, and returns the ``Figure``. None of them runs the engine:
a figure shows exactly what the trace recorded, so re-running a notebook cell redraws
the same run instead of producing a new one. Figures made here have fixed sizes so they
look the same in every notebook and in ``figures/``.

A request keeps one colour in every picture (:func:`request_color`), so the request
that fills blocks 3, 7 and 9 in the block table is the same colour as its bars in the
batch composition and its row in the timeline.

    from minivllm import viz
    fig = viz.plot_batch_composition(llm.trace)
    viz.save_figure(fig, "batch_composition")
    viz.replay(llm.trace)        # step slider + play button in Jupyter
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

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
BATCH_SIZE = (10.0, 4.5)
TIMELINE_SIZE = (10.0, 5.0)
LATENCY_SIZE = (10.0, 4.0)
KV_USAGE_SIZE = (10.0, 3.5)
MEMORY_WASTE_SIZE = (7.0, 4.5)
REPLAY_SIZE = (14.0, 5.5)

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


# -- the paged KV cache ---------------------------------------------------------------


def block_owners(record: StepRecord) -> dict[int, list[str]]:
    """Physical block id -> the requests whose block tables list it, after this step."""
    owners: dict[int, list[str]] = {}
    for rid, table in record.block_tables.items():
        for b in table:
            owners.setdefault(b, []).append(rid)
    return owners


def plot_block_table(
    trace: Trace, step: int = -1, request_id: str | None = None, ax: Axes | None = None
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
    defaults to the running request holding the most blocks.
    """
    record = _get_step(trace, step)
    fig, ax = _new_axes(ax, BLOCK_TABLE_SIZE)
    n = record.num_blocks
    ncols = min(n, 16)
    nrows = math.ceil(n / ncols)
    owners = block_owners(record)

    for b in range(n):
        row, col = divmod(b, ncols)
        who = owners.get(b)
        refs = record.block_ref_counts.get(b, len(who) if who else 0)
        face = request_color(who[0]) if who else FREE_COLOR
        rect = Rectangle((col, row), 0.92, 0.92, facecolor=face, edgecolor="#555555",
                         linewidth=0.6, hatch="xx" if refs > 1 else None)
        rect.set_gid(f"block:{b}")
        ax.add_patch(rect)
        label = f"{b}\nref {refs}" if refs > 1 else str(b)
        if n <= 256:
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
        caption = (f"block table of request {request_id}: logical block i -> physical block "
                   f"{table if len(table) <= 12 else table[:12] + ['...']}")
    elif request_id is not None:
        caption = f"request {request_id} holds no blocks after this step"
    else:
        caption = "no running request holds blocks after this step"
    ax.text(0, map_top + 1.5, caption, fontsize=9, va="center")

    ax.set_xlim(-0.2, ncols + 0.2)
    ax.set_ylim(map_top + 2.0, -0.3)  # row 0 on top
    ax.set_aspect("equal" if nrows <= 12 else "auto")
    ax.axis("off")
    used = n - record.num_free_blocks
    ax.set_title(f"KV block pool after step {record.step}: {used}/{n} blocks owned "
                 f"({100 * record.kv_cache_usage:.0f}%)\nblock size {trace.block_size}, "
                 f"colour = owning request, hatched = shared (ref > 1)", fontsize=10)
    return fig


# -- what each step computed ----------------------------------------------------------


def plot_batch_composition(
    trace: Trace, ax: Axes | None = None, highlight_step: int | None = None
) -> Figure:
    """Per step, a stacked bar of the tokens each request contributed to the batch.

    One forward pass computes every scheduled token together, prompt chunks and decodes
    alike; the token budget (``max_num_batched_tokens``, the dashed line) bounds the sum.
    Prefill chunks are hatched, decodes solid, in the request's colour. Watch a long
    prompt arrive: with chunked prefill it is cut to fill what the decodes leave of the
    budget, so the decodes keep running in every step (notebooks 04 and 06).

    ``highlight_step`` (an index into ``trace.steps``) shades one step, for replay.
    """
    if not trace.steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    fig, ax = _new_axes(ax, BATCH_SIZE)
    for record in trace.steps:
        bottom = 0
        for c in record.scheduled:
            bar = ax.bar(record.step, c.num_tokens, bottom=bottom, width=0.8,
                         color=request_color(c.request_id), edgecolor="white", linewidth=0.4,
                         hatch=PREFILL_HATCH if c.is_prefill else None)
            bar.patches[0].set_gid(f"step:{record.step}:{c.request_id}")
            bottom += c.num_tokens
    ax.axhline(trace.max_num_batched_tokens, color="black", linestyle="--", linewidth=1)
    if highlight_step is not None:
        s = _get_step(trace, highlight_step).step
        ax.axvspan(s - 0.5, s + 0.5, color="gold", alpha=0.3, zorder=0)
    handles = [
        Patch(facecolor="#999999", hatch=PREFILL_HATCH, edgecolor="white", label="prefill chunk"),
        Patch(facecolor="#999999", label="decode (1 token)"),
        plt.Line2D([], [], color="black", linestyle="--",
                   label=f"token budget ({trace.max_num_batched_tokens})"),
    ]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the batch")
    ax.set_ylim(0, trace.max_num_batched_tokens * 1.25)
    ax.set_title("Batch composition: tokens each request contributed per step "
                 "(colour = request)", fontsize=10)
    return fig


def request_spans(trace: Trace) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """For each request, its (start, duration) spans by phase: "waiting", "prefill",
    "decode" and "preempted". Times are the engine clock's, from the step records."""
    spans = {rid: {"waiting": [], "prefill": [], "decode": [], "preempted": []}
             for rid in trace.requests}
    preempted_at: dict[str, float] = {}
    for record in trace.steps:
        for c in record.scheduled:
            if c.request_id not in spans:
                continue
            if c.request_id in preempted_at:
                t = preempted_at.pop(c.request_id)
                spans[c.request_id]["preempted"].append((t, record.start - t))
            kind = "prefill" if c.is_prefill else "decode"
            spans[c.request_id][kind].append((record.start, record.duration))
        for rid in record.preempted:
            preempted_at[rid] = record.end
    for rid, m in trace.requests.items():
        if m.first_scheduled_time is not None:
            spans[rid]["waiting"].append((m.arrival_time, m.first_scheduled_time - m.arrival_time))
        if rid in preempted_at:  # preempted and never rescheduled (aborted, or still waiting)
            end = m.finished_time if m.finished_time is not None else preempted_at[rid]
            spans[rid]["preempted"].append((preempted_at[rid], end - preempted_at[rid]))
    return spans


def plot_request_timeline(trace: Trace, ax: Axes | None = None) -> Figure:
    """One row per request: waiting (grey), prefill (orange), decode (blue) and
    preempted (red) spans, with a tick at every output token.

    Read a request's latencies off its row: queue time is the grey bar, time to first
    token runs from its start to the first tick, and the tick spacing is the inter-token
    latency. A red span is time lost to preemption: the request's blocks were taken,
    and it waits to recompute them (notebook 08). Time is seconds since the first
    arrival.
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
                coll = ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=color,
                                      hatch="xx" if kind == "preempted" else None)
                coll.set_gid(f"{kind}:{rid}")
        m = trace.requests[rid]
        if m.token_times:
            ax.plot([t - t0 for t in m.token_times], [row] * len(m.token_times), "|",
                    color="black", markersize=9, gid=f"tokens:{rid}")
        ax.plot([m.arrival_time - t0], [row], marker="o", color=request_color(rid), markersize=5)
    ax.set_yticks(range(len(order)), labels=order if len(order) <= 40 else None)
    if len(order) > 40:
        ax.set_yticks([])
    ax.set_ylim(len(order) - 0.5, -0.5)  # first arrival on top
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("request")
    handles = [Patch(facecolor=c, label=k) for k, c in colors.items()]
    handles.append(plt.Line2D([], [], color="black", marker="|", linestyle="", label="token"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title("Request timeline: waiting, prefill, decode and preempted time", fontsize=10)
    return fig


# -- latency and memory ---------------------------------------------------------------


def _percentile_lines(ax: Axes, values_ms: list[float], color: str, name: str) -> None:
    for q, style in ((50, "-"), (90, "--"), (99, ":")):
        x = float(np.percentile(values_ms, q))
        ax.axvline(x, color=color, linestyle=style, linewidth=1.3,
                   label=f"{name} p{q} = {x:.1f} ms", gid=f"{name}:p{q}")


def plot_latency(trace: Trace, ax: Axes | Sequence[Axes] | None = None) -> Figure:
    """Distributions of time to first token (left) and inter-token latency (right),
    in milliseconds, with p50 / p90 / p99 marked.

    Users feel both: TTFT is how long the screen stays blank, ITL how smoothly text
    streams. Tails matter more than means, which is why serving dashboards (and vLLM's
    benchmarks) report percentiles. Pass two Axes to draw into your own layout, or one
    to overlay both.
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
        a.hist(values, bins=min(30, max(5, len(values) // 2)), color=color, alpha=0.6,
               label=f"{name} ({len(values)} samples)")
        _percentile_lines(a, values, color, name)
        a.set_xlabel("milliseconds")
        a.set_ylabel("count")
        a.legend(fontsize=8)
    if axes[0] is not axes[1]:
        axes[0].set_title("Time to first token", fontsize=10)
        axes[1].set_title("Inter-token latency", fontsize=10)
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


# -- interactive replay -----------------------------------------------------------------


def _replay_figure(trace: Trace, step: int, request_id: str | None = None) -> Figure:
    fig = _new_figure(REPLAY_SIZE)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.2]})
    plot_block_table(trace, step, request_id, ax=left)
    plot_batch_composition(trace, ax=right, highlight_step=step)
    record = trace.steps[step]
    parts = [f"{c.request_id}: {'prefill' if c.is_prefill else 'decode'} {c.num_tokens}"
             for c in record.scheduled[:8]]
    more = f" (+{len(record.scheduled) - 8} more)" if len(record.scheduled) > 8 else ""
    fig.suptitle(f"step {record.step}: " + ", ".join(parts) + more, fontsize=10)
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

    In Jupyter this returns an ipywidgets box (display it, or leave it as the cell's
    last line). Without a widget front end (plain Python, a script, nbconvert without
    widget state) it draws the first step statically and returns that Figure, so a
    notebook still shows a picture when read as a static page.
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


# -- saving ---------------------------------------------------------------------------


def figures_dir() -> Path:
    """The repository's ``figures/`` folder when running from a checkout, else
    ``./figures`` (created if missing)."""
    repo_figures = Path(__file__).resolve().parents[1] / "figures"
    folder = repo_figures if repo_figures.is_dir() else Path.cwd() / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_figure(fig: Figure, name: str, dpi: int = 120) -> Path:
    """Write ``fig`` to ``figures/<name>`` (PNG unless ``name`` ends in .svg or .pdf);
    return the path."""
    path = figures_dir() / name
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        path = path.with_name(path.name + ".png")
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path
