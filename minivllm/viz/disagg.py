"""Disaggregated prefill drawn (notebook 16): what a long prompt does to the steps of the
requests decoding beside it, the KV connector's calls as a sequence diagram, where the
copies of a prefix's KV blocks live (engine cache, RAM, disk), the measured layouts side
by side, and the simulated goodput of colocated engines against prefill and decode pools.

Like every figure in :mod:`minivllm.viz`, these take records and numbers and return the
Figure; none of them runs an engine. The connector's calls come as :class:`ConnectorCall`
records, which a notebook makes by wrapping a real connector's methods; the other inputs
are a :class:`~minivllm.trace.Trace`, rows of ``minivllm.bench.disagg`` or plain sets.
"""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from minivllm.trace import Trace
from minivllm.viz.style import DECODE_COLOR, PREFILL_COLOR, _new_figure, _note_time_source

INTERFERENCE_SIZE = (11.0, 5.4)
CALL_ROW_INCHES = 0.27
"""Height of one row of the sequence diagram (one call, or one step's heading)."""
TIER_COLORS = {"engine": DECODE_COLOR, "RAM": "#59a14f", "disk": "#9c755f"}
"""One colour per place a KV block can live: the engine's own cache, the CPU tier, the disk tier."""
LAYOUT_COLORS = {"one engine": DECODE_COLOR, "two replicas": "#b07aa1", "disaggregated": "#59a14f"}
"""The measured layouts of ``minivllm bench disagg``; a simulated "N colocated" takes the
one engine's colour and each prefill/decode split the next colour of tab10."""


def layout_color(name: str, index: int = 0) -> str | tuple[float, float, float]:
    if name in LAYOUT_COLORS:
        return LAYOUT_COLORS[name]
    if name.endswith("colocated"):
        return DECODE_COLOR
    return plt.get_cmap("tab10").colors[(index + 1) % 10]


# -- a long prompt among decodes ---------------------------------------------------------------
def _prefill_runs(trace: Trace, watched: Collection[str]) -> list[tuple[float, float, int, int]]:
    """(start, end, prompt tokens, steps) of each run of consecutive steps that compute
    prompt tokens of a request not in ``watched``."""
    runs: list[list] = []
    last = None
    for record in trace.steps:
        tokens = sum(c.num_new_tokens for c in record.scheduled if c.is_prefill and c.request_id not in watched)
        if not tokens:
            continue
        if runs and last == record.step - 1:
            runs[-1][1:] = [record.end, runs[-1][2] + tokens, runs[-1][3] + 1]
        else:
            runs.append([record.start, record.end, tokens, 1])
        last = record.step
    return [tuple(r) for r in runs]


def plot_prefill_interference(panels: Sequence[tuple[str, Trace]], watched: Collection[str],
                              time_source: str | None = None) -> Figure:
    """One row per engine, on one time axis: every gap between two tokens of the
    ``watched`` requests (the chat streams) as a point at the time of the later token,
    over a shaded band for each run of steps that computed prompt tokens of another request.

    What it shows: a step lasts as long as its slowest part, so a step that carries a
    chunk of a long prompt makes every request decoding in it wait for the chunk. On a
    decode instance the long prompt's KV arrives computed and only its last partial block
    runs, so the bands shrink to one short step and the gaps stay flat. A row whose engine
    decodes none of the watched requests (a prefill instance) is drawn as a thin strip of
    its bands. ``time_source`` names where the seconds come from (simulated ones)."""
    if not panels:
        raise ValueError("give at least one (label, trace) panel")
    has_points = [any(r in t.requests for r in watched) for _, t in panels]
    fig = _new_figure(INTERFERENCE_SIZE)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        height_ratios=[1.0 if p else 0.3 for p in has_points])[:, 0]
    gaps = {label: [(b, 1e3 * (b - a)) for r in watched if r in t.requests
                    for a, b in zip(t.requests[r].token_times, t.requests[r].token_times[1:])]
            for label, t in panels}
    top = max((g for points in gaps.values() for _, g in points), default=1.0) * 1.3
    for ax, (label, trace), points in zip(axes, panels, has_points):
        for start, end, tokens, steps in _prefill_runs(trace, watched):
            ax.axvspan(start, end, color=PREFILL_COLOR, alpha=0.3, linewidth=0, gid=f"prefill:{label}")
            ax.text(start, 0.97, f" {tokens:,} prompt tokens, {steps} step{'s' * (steps != 1)}",
                    transform=ax.get_xaxis_transform(), fontsize=7, va="top", ha="left")
        if points:
            xs, ys = zip(*gaps[label]) if gaps[label] else ((), ())
            ax.plot(xs, ys, ".", ms=4, color=DECODE_COLOR, gid=f"itl:{label}")
            ax.set_ylim(0, top)
            ax.set_ylabel("gap between two\ntokens (ms)", fontsize=8)
        else:
            ax.set_yticks([])
        ax.set_title(label, fontsize=9, loc="left")
        ax.grid(alpha=0.3, axis="x")
    axes[-1].set_xlabel("time (s)")
    _note_time_source(axes[-1], time_source)
    fig.legend(handles=[Patch(color=PREFILL_COLOR, alpha=0.3, label="steps that compute another request's prompt"),
                        Line2D([], [], ls="", marker=".", color=DECODE_COLOR, label="a chat stream's gap between two tokens")],
               loc="outside lower center", ncol=2, fontsize=8)
    return fig


# -- the connector's calls -----------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorCall:
    """One call into a KV connector: in which engine step, from which half of the engine
    (``side``: "scheduler side", "worker side", anything else drawn beside the scheduler),
    by whom (``caller``: "Scheduler.schedule_waiting", "attention.paged_attention_forward"),
    which method, a short ``note`` (what it returned), and how many times in a row."""

    step: int
    side: str
    caller: str
    method: str
    note: str = ""
    repeat: int = 1


def condense_calls(calls: Sequence[ConnectorCall]) -> list[ConnectorCall]:
    """Consecutive calls from one caller in one step that repeat a pattern become one
    record per method of the pattern with ``repeat`` set: the attention function's
    ``wait_for_layer_load``, ``save_kv_layer``, once per layer, becomes two records with
    ``repeat`` = the number of layers (and no note: the notes differ from layer to layer)."""
    out: list[ConnectorCall] = []
    i = 0
    while i < len(calls):
        key = (calls[i].step, calls[i].side, calls[i].caller)
        j = i
        while j < len(calls) and (calls[j].step, calls[j].side, calls[j].caller) == key:
            j += 1
        run = calls[i:j]
        period = next(p for p in range(1, len(run) + 1) if len(run) % p == 0
                      and all(c.method == run[k % p].method for k, c in enumerate(run)))
        times = len(run) // period
        out += [replace(c, repeat=times, note=c.note if times == 1 else "") for c in run[:period]]
        i = j
    return out


def _lifelines(calls: Sequence[ConnectorCall]) -> tuple[list[str], dict[str, int]]:
    """Columns left to right: the scheduler side's callers, the connector's two halves,
    the worker side's callers (each in order of first appearance)."""
    owners = {"scheduler": [], "worker": []}
    for c in calls:
        group = "worker" if c.side == "worker side" else "scheduler"
        owner = c.caller.partition(".")[0]
        if owner not in owners[group]:
            owners[group].append(owner)
    names = owners["scheduler"] + ["connector\n(scheduler side)", "connector\n(worker side)"] + owners["worker"]
    return names, {n: i for i, n in enumerate(names)}


def _draw_sequence(ax: Axes, title: str, calls: Sequence[ConnectorCall], num_rows: int) -> None:
    names, column = _lifelines(calls)
    for x, name in enumerate(names):
        half = name.startswith("connector")
        ax.axvline(x, color=PREFILL_COLOR if half else "0.6", lw=2.5 if half else 1, zorder=0)
        ax.text(x, -0.9, name, ha="center", va="bottom", fontsize=8, fontweight="bold" if half else "normal")
    y, step = 0.0, None
    for c in calls:
        if c.step != step:
            step = c.step
            ax.axhline(y, color="0.3", lw=0.6, ls="--")
            ax.text(-0.55, y + 0.05, f"step {step}", fontsize=8, fontweight="bold", va="top")
            y += 1
        worker = c.side == "worker side"
        x0 = column[c.caller.partition(".")[0]]
        x1 = column["connector\n(worker side)" if worker else "connector\n(scheduler side)"]
        ax.annotate("", (x1, y), (x0, y), arrowprops=dict(arrowstyle="->", color="0.15", lw=1),
                    gid=f"call:{c.method}")
        label = f"{c.method}()" + (f" x {c.repeat}" if c.repeat > 1 else "") + (f" -> {c.note}" if c.note else "")
        caller = c.caller.partition(".")[2]
        ax.text((x0 + x1) / 2, y - 0.12, label, ha="center", va="bottom", fontsize=7)
        ax.text(x0 + (0.08 if x1 > x0 else -0.08), y + 0.1, caller, ha="left" if x1 > x0 else "right",
                va="top", fontsize=6, color="0.4")
        y += 1
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(num_rows, -1.0)
    ax.axis("off")
    ax.set_title(title, fontsize=10, pad=24)


def plot_connector_calls(panels: Sequence[tuple[str, Sequence[ConnectorCall]]]) -> Figure:
    """One sequence diagram per engine (panel), time running down: a lifeline for each
    caller and for each half of the connector, one arrow per call (from the caller, which
    is named in grey under the arrow's tail, to the half it calls), and a heading where
    each engine step begins. Pass :func:`condense_calls`' records to fold the per-layer
    calls.

    What it shows: the scheduler side decides what moves (between steps, where blocks are
    allocated), the worker side moves it (around and inside the forward pass, layer by
    layer), and the only thing crossing between them is the metadata built once a step."""
    if not panels or not all(calls for _, calls in panels):
        raise ValueError("give at least one (title, calls) panel, each with calls")
    rows = max(len(calls) + len({c.step for c in calls}) for _, calls in panels)
    fig = _new_figure((7.6 * len(panels), 1.2 + CALL_ROW_INCHES * rows))
    for ax, (title, calls) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        _draw_sequence(ax, title, calls, rows)
    return fig


# -- the tiers of KV cache -----------------------------------------------------------------
def plot_tier_residency(moments: Sequence[tuple[str, Sequence[Collection[str]]]],
                        tiers: Sequence[str] = ("engine", "RAM", "disk"), ax: Axes | None = None) -> Figure:
    """Where each copy of a prefix's KV blocks lives, moment by moment: one column per
    moment (its label under it), one row per block of the prefix, and in each cell one
    square per tier, filled in the tier's colour when the tier holds the block.

    What it shows: a block computed once is kept in several places at once. The engine's
    own cache is the smallest and forgets first; the CPU tier keeps a copy when the engine
    evicts it, the disk tier when the CPU tier does, and the disk's copy outlives the
    engine. A request finds its prefix in the fastest place that still has it.
    ``moments``: (label, for each block the set of tier names holding it)."""
    if not moments or not all(len(blocks) == len(moments[0][1]) for _, blocks in moments):
        raise ValueError("give at least one moment, each with the same blocks")
    num_blocks, width = len(moments[0][1]), 0.8 / len(tiers)
    if ax is None:
        fig = _new_figure((1.6 * len(moments) + 1.2, 0.45 * num_blocks + 2.2))
        ax = fig.add_subplot()
    fig = ax.figure
    for m, (_, blocks) in enumerate(moments):
        for b, held in enumerate(blocks):
            for t, tier in enumerate(tiers):
                inside = tier in held
                ax.add_patch(Rectangle((m - 0.4 + t * width, b - 0.35), width * 0.9, 0.7,
                                       facecolor=TIER_COLORS.get(tier, "0.5") if inside else "white",
                                       edgecolor=TIER_COLORS.get(tier, "0.5"), lw=0.8,
                                       gid=f"tier:{tier}:{m}:{b}:{'in' if inside else 'out'}"))
    ax.set_xlim(-0.55, len(moments) - 0.45)
    ax.set_ylim(num_blocks - 0.5, -0.5)
    ax.set_xticks(range(len(moments)), [textwrap.fill(label, 20) for label, _ in moments], fontsize=8)
    ax.set_yticks(range(num_blocks), [f"block {b}" for b in range(num_blocks)], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title("Where the prefix's KV blocks are, after each request", fontsize=10)
    fig.legend(handles=[Patch(facecolor=TIER_COLORS.get(t, "0.5"), label=f"held by {t}") for t in tiers],
               loc="outside lower center", ncol=len(tiers), fontsize=8)
    return fig


# -- the measured layouts and the simulated goodput ----------------------------------------------
def plot_disagg_layouts(rows: Sequence[object]) -> Figure:
    """Left: the chat streams' inter-token latency (p50, p90, p99; log axis) in each
    layout; right: the long prompts' time to first token (p50, p99). ``rows``: the
    :class:`minivllm.bench.disagg.DisaggRow` list (anything with ``layout``, ``itl`` and
    ``long_ttft`` in seconds).

    What it shows: the percentiles are the spread. A split helps where a long prompt's
    chunks stretched the decodes' steps, that is in the tail (p99), and it costs where a
    layout with fewer cores per instance or a KV transfer makes the ordinary step or the
    first token slower."""
    if not rows:
        raise ValueError("no rows to draw: run minivllm.bench.disagg.disagg_benchmark first")
    fig = _new_figure((11.0, 3.8))
    left, right = fig.subplots(1, 2, width_ratios=(1.5, 1))
    for ax, field, names in ((left, "itl", ("p50", "p90", "p99")), (right, "long_ttft", ("p50", "p99"))):
        width = 0.8 / len(rows)
        for k, row in enumerate(rows):
            values = [1e3 * v for v in getattr(row, field)]
            xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, values, width * 0.95, color=layout_color(row.layout, k), label=row.layout,
                   gid=f"{field}:{row.layout}")
        ax.set_xticks(range(len(names)), names)
        ax.set_yscale("log")
    left.set_ylabel("ms (log)")
    left.set_title("Chat streams: gap between two tokens", fontsize=10)
    right.set_title("Long prompts: time to first token", fontsize=10)
    fig.legend(handles=[Patch(color=layout_color(r.layout, k), label=r.layout) for k, r in enumerate(rows)],
               loc="outside lower center", ncol=len(rows), fontsize=8)
    return fig


def plot_goodput_sweep(rows: Sequence[Mapping], ttft_bound: float, tpot_bound: float,
                       time_source: str | None = None) -> Figure:
    """Against the request rate, one line per layout: the share of requests within both
    bounds (left, with the 90% line that defines goodput), the p90 time to first token
    (middle) and the p90 time per output token (right), each beside its bound. ``rows``:
    what :func:`minivllm.sim.disagg_simulator.goodput_sweep` returns (``rate``,
    ``layout``, ``attainment``, ``ttft_p90``, ``tpot_p90``).

    What it shows: why each layout stops meeting its bounds. A colocated engine's decodes
    share steps with prompts, so its TPOT rises with the rate; a pool with too few prefill
    instances queues prompts and misses the TTFT bound; the split that balances the two
    keeps both longest."""
    if not rows:
        raise ValueError("no sweep rows to draw: run goodput_sweep first")
    fig = _new_figure((13.0, 3.8))
    axes = fig.subplots(1, 3)
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    for k, layout in enumerate(layouts):
        mine = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["rate"])
        rates, color = [r["rate"] for r in mine], layout_color(layout, k)
        for ax, key, scale in zip(axes, ("attainment", "ttft_p90", "tpot_p90"), (100, 1, 1e3)):
            ax.plot(rates, [scale * r[key] for r in mine], "o-", color=color, gid=f"{key}:{layout}")
    for ax, y, text in zip(axes, (90, ttft_bound, 1e3 * tpot_bound), ("goodput line", "bound", "bound")):
        ax.axhline(y, color="0.3", ls="--", lw=1)
        ax.text(0.01, y, f" {text}", transform=ax.get_yaxis_transform(), fontsize=7, va="bottom")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[0].set_ylabel("requests within both bounds (%)")
    axes[1].set_ylabel("TTFT p90 (s)")
    axes[2].set_ylabel("TPOT p90 (ms)")
    axes[1].set_yscale("log")
    axes[0].set_title(f"Within TTFT <= {ttft_bound:g} s and TPOT <= {1e3 * tpot_bound:g} ms", fontsize=10)
    axes[1].set_title("Time to first token", fontsize=10)
    axes[2].set_title("Time per output token", fontsize=10)
    fig.legend(handles=[Line2D([], [], marker="o", color=layout_color(n, k), label=n) for k, n in enumerate(layouts)],
               loc="outside lower center", ncol=len(layouts), fontsize=8,
               title=f"times: {time_source}" if time_source else None, title_fontsize=7)
    return fig
