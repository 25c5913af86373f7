"""What each step computed: the batch composition (tokens and requests per step) and
the flat batch the model runner builds for one step (notebook 04)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from minivllm.trace import Trace
from minivllm.viz.style import (
    BATCH_SIZE,
    FLAT_BATCH_SIZE,
    PREFILL_HATCH,
    _get_step,
    _new_axes,
    _new_figure,
    _request_key,
    request_colors,
    short_id,
    trace_colors,
)

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
    colors = trace_colors(trace)
    for record in trace.steps:
        bottom = 0
        for i, c in enumerate(record.scheduled):
            color = colors[c.request_id]
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
        _request_key(axes[-1], order, colors=colors)
    axes[-1].set_xlabel("engine step")
    if highlight_step is not None:
        s = _get_step(trace, highlight_step).step
        for a in axes:
            a.axvspan(s - 0.5, s + 0.5, color="gold", alpha=0.3, zorder=0)
    return fig


def _ink_on(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (drawn at alpha 0.8 on white)."""
    r, g, b = (0.8 * c + 0.2 for c in to_rgb(fill))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


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
    colors = request_colors(request_ids)
    owner = [s for s in range(nseq) for _ in range(qsl[s], qsl[s + 1])]
    rows = [("input_ids", ids), ("positions", pos), ("slot_mapping", slots)]
    fs = 7 if n <= 24 else 5.5 if n <= 48 else 4
    for r, (name, values) in enumerate(rows):
        ax.text(-0.3, r + 0.5, name, ha="right", va="center", fontsize=8, family="monospace")
        for t, v in enumerate(values):
            color = colors[request_ids[owner[t]]]
            cell = Rectangle((t, r), 0.95, 0.95, facecolor=color, alpha=0.35, edgecolor="#555555",
                             linewidth=0.4)
            cell.set_gid(f"{name}:{t}")
            ax.add_patch(cell)
            ax.text(t + 0.47, r + 0.48, str(v), ha="center", va="center",
                    fontsize=fs if len(str(v)) < 5 or n > 24 else 0.75 * fs,  # 5 digits fill a cell
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
        where = (f"1 new token at position {pos[qsl[s]]}" if q_len == 1 else
                 f"{q_len} new tokens at positions {pos[qsl[s]]}-{pos[qsl[s + 1] - 1]}")
        ax.text(0, y, f"request {request_ids[s]}: {kind}, {where}, seq_lens = {lens[s]}; its block table "
                      f"(block i holds positions {block_size}i to {block_size}i+{block_size - 1}):",
                fontsize=8, va="center")
        for j, b in enumerate(tables[s]):
            cell = Rectangle((0.9 * j, y + 0.45), 0.85, 0.8,
                             facecolor=colors[request_ids[s]] if j < real else "white",
                             edgecolor="#555555", linewidth=0.5, alpha=0.8 if j < real else 1.0)
            cell.set_gid(f"table:{s}:{j}")
            ax.add_patch(cell)
            ax.text(0.9 * j + 0.42, y + 0.85, str(b), ha="center", va="center", fontsize=7,
                    color=_ink_on(colors[request_ids[s]]) if j < real else "#999999")
    width = max(map(len, tables), default=0)
    ax.set_xlim(-7.5, max(n, 0.9 * width, 24) + 0.5)
    ax.set_ylim(y0 + 2.0 * nseq, -0.8)
    ax.axis("off")
    handles = [Patch(facecolor=colors[r], alpha=0.5, label=f"request {short_id(r)}") for r in request_ids]
    handles.append(Line2D([], [], color="black", marker="*", linestyle="", label="logits computed"))
    handles.append(Line2D([], [], color="black", linestyle="--", label="a new cache block begins"))
    if any(len(t) > math.ceil(length / block_size) for t, length in zip(tables, lens)):
        handles.append(Patch(facecolor="white", edgecolor="#555555", label="block table padding"))
    # Beside the token grid (not at the far edge of the axes, which the long per-sequence
    # lines below set): the key sits next to what it explains.
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(max(n, 0.9 * width) + 0.8, -0.8),
              bbox_transform=ax.transData, fontsize=7)
    ax.set_title(f"One step's flat batch: {n} tokens of {nseq} requests, block size {block_size}",
                 fontsize=10)
    return fig
