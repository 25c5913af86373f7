"""The paged KV cache drawn: the block pool with one request's block table (logical
block -> physical block), its usage over the run, and paged against contiguous memory."""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minivllm.trace import StepRecord, Trace
from minivllm.viz.style import (
    BLOCK_TABLE_SIZE,
    DECODE_COLOR,
    FREE_COLOR,
    KV_USAGE_SIZE,
    MEMORY_WASTE_SIZE,
    PREEMPTED_COLOR,
    _get_step,
    _new_axes,
    _request_key,
    request_color,
    short_id,
    trace_colors,
)

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
    colors = trace_colors(trace)

    for b in range(shown):
        row, col = divmod(b, ncols)
        who = owners.get(b)
        refs = record.block_ref_counts.get(b, len(who) if who else 0)
        face = colors.get(who[0], request_color(who[0])) if who else FREE_COLOR
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
        color = colors.get(request_id, request_color(request_id))
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
        caption = (f"block table of request {short_id(request_id)}: logical block Li -> physical block "
                   f"[{', '.join(map(str, table[:12]))}{', ...' if len(table) > 12 else ''}]")
    elif request_id is not None:
        caption = f"request {short_id(request_id)} holds no blocks after this step"
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
        _request_key(ax, list(running), below=True, colors=colors)
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
