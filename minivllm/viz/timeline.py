"""One row per request across the run: waiting, prefill, decode, preempted."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from minivllm.trace import Trace
from minivllm.viz.style import (
    DECODE_COLOR,
    PREEMPTED_COLOR,
    PREFILL_COLOR,
    TIMELINE_SIZE,
    WAITING_COLOR,
    _new_axes,
    _note_time_source,
    _set_row_limits,
    short_id,
    trace_colors,
)


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
                spans[c.request_id]["preempted"].append((t, start - t))
            kind = "prefill" if c.is_prefill else "decode"
            spans[c.request_id][kind].append((start, end - start))
        # A request is preempted while the step is scheduled, before its forward pass: it
        # is out of the batch for the whole of that step (no gap before the red span).
        for rid in record.preempted:
            preempted_at[rid] = start
    for rid, m in trace.requests.items():
        if m.first_scheduled_time is not None:
            spans[rid]["waiting"].append((m.arrival_time, m.first_scheduled_time - m.arrival_time))
        if rid in preempted_at:  # preempted and never rescheduled (aborted, or still waiting)
            end = m.finished_time if m.finished_time is not None else preempted_at[rid]
            spans[rid]["preempted"].append((preempted_at[rid], end - preempted_at[rid]))
    return {rid: {k: _merge(v) for k, v in kinds.items()} for rid, kinds in spans.items()}


def plot_request_timeline(trace: Trace, ax: Axes | None = None, tokens: bool = True,
                          legend: bool = True) -> Figure:
    """One row per request: waiting (grey), prefill (orange), decode (blue) and
    preempted (red) spans (the key names those the run has), a tick at every output token, a dot at its arrival.

    Read a request's latencies off its row: queue time is the grey bar, time to first
    token runs from its arrival dot to the first tick, and the tick spacing is the
    inter-token latency. A red span is time lost to preemption: the request's blocks were
    taken, and it waits to recompute them (notebook 08). Time is seconds since the first
    arrival. The arrival dot has the request's colour (the one it has in every figure).
    ``tokens=False`` leaves out the ticks (with many long requests they cover the bars);
    ``legend=False`` the key (two panels side by side need only one).
    """
    if not trace.requests:
        raise ValueError("the trace has no requests yet: run the engine first")
    fig, ax = _new_axes(ax, TIMELINE_SIZE)
    order = sorted(trace.requests, key=lambda r: trace.requests[r].arrival_time)
    t0 = min(m.arrival_time for m in trace.requests.values())
    spans = request_spans(trace)
    arrival_colors = trace_colors(trace)
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
        if tokens and m.token_times:
            ax.plot([t - t0 for t in m.token_times], [row] * len(m.token_times), "|",
                    color="black", markersize=9, gid=f"tokens:{rid}")
        ax.plot([m.arrival_time - t0], [row], marker="o", color=arrival_colors[rid], markersize=5,
                markeredgecolor="black", markeredgewidth=0.5, gid=f"arrival:{rid}")
    ax.set_yticks(range(len(order)), labels=[short_id(r) for r in order] if len(order) <= 40 else None)
    if len(order) > 40:
        ax.set_yticks([])
    _set_row_limits(ax, len(order), trace.time_source)  # first arrival on top
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("request")
    # The key names the kinds of span this run has: a lesson before notebook 08 shows
    # no "preempted" it has not taught.
    shown = [k for k in colors if any(d > 0 for rid in order for _, d in spans[rid][k])]
    handles = [Patch(facecolor=colors[k], label=k, hatch="xx" if k == "preempted" else None)
               for k in shown]
    if tokens:
        handles.append(Line2D([], [], color="black", marker="|", linestyle="", markersize=9,
                              label="output token"))
    handles.append(Line2D([], [], color="#999999", marker="o", linestyle="", markersize=5,
                          markeredgecolor="black", markeredgewidth=0.5,
                          label="arrival (request colour)"))
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    kinds = ", ".join(shown[:-1]) + (" and " if len(shown) > 1 else "") + (shown[-1] if shown else "")
    ax.set_title(f"Request timeline: {kinds} time", fontsize=10)
    _note_time_source(ax, trace.time_source)
    return fig


GROUP_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:olive")
"""Colours of the request groups in :func:`plot_priority_timeline`, in order of first arrival."""


def plot_priority_timeline(trace: Trace, groups: Mapping[str, str], ax: Axes | None = None,
                           title: str | None = None, legend: bool = True) -> Figure:
    """One row per request, coloured by its group (e.g. "interactive" and "batch"):
    a pale bar from arrival to first token (its TTFT: queueing and prefill), a solid bar
    from first token to finish, red hatching where it was preempted.

    Drawn for two runs of the same workload (``minivllm bench priority``: fcfs and
    priority), it shows where the interactive requests' waiting went: under fcfs their
    pale bars stretch until the batch requests ahead of them are admitted; under priority
    they are admitted at the next free seat. ``groups`` maps request id to group name;
    requests it does not name are left out. :func:`plot_priority_timelines` draws several
    runs side by side with one key.
    """
    rids = [rid for rid in trace.requests if rid in groups]
    if not rids:
        raise ValueError("no request of the trace is in groups: run the engine first, or "
                         "check the request ids")
    fig, ax = _new_axes(ax, TIMELINE_SIZE)
    order = sorted(rids, key=lambda r: trace.requests[r].arrival_time)  # stable: ties in add order
    color = _group_colors(trace, groups)
    t0 = min(trace.requests[r].arrival_time for r in order)
    preempted = request_spans(trace)
    for row, rid in enumerate(order):
        m, c = trace.requests[rid], color[groups[rid]]
        if m.first_token_time is not None:
            ax.broken_barh([(m.arrival_time - t0, m.first_token_time - m.arrival_time)],
                           (row - 0.35, 0.7), facecolors=c, alpha=0.3, edgecolors="none",
                           gid=f"ttft:{rid}")
            if m.finished_time is not None:
                ax.broken_barh([(m.first_token_time - t0, m.finished_time - m.first_token_time)],
                               (row - 0.35, 0.7), facecolors=c, edgecolors="none", gid=f"output:{rid}")
        lost = [(s - t0, d) for s, d in preempted[rid]["preempted"]]
        if lost:
            ax.broken_barh(lost, (row - 0.35, 0.7), facecolors="none", edgecolors=PREEMPTED_COLOR,
                           hatch="xx", gid=f"preempted:{rid}")
    _set_row_limits(ax, len(order), trace.time_source)  # first arrival on top
    ax.set_yticks([])
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("requests, by arrival")
    if legend:
        ax.legend(handles=_group_handles(color), loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize=8)
    ax.set_title(title or "Requests by group: time to first token (pale) and generation (solid)",
                 fontsize=10)
    _note_time_source(ax, trace.time_source)
    return fig


def _group_colors(trace: Trace, groups: Mapping[str, str]) -> dict[str, str]:
    """Group name -> colour, in the order the groups first arrive."""
    order = sorted((r for r in trace.requests if r in groups), key=lambda r: trace.requests[r].arrival_time)
    names = dict.fromkeys(groups[r] for r in order)
    return {g: GROUP_COLORS[i % len(GROUP_COLORS)] for i, g in enumerate(names)}


def _group_handles(color: Mapping[str, str]) -> list[Patch]:
    handles = [Patch(facecolor=c, alpha=0.3, label=f"{g}: waiting for first token")
               for g, c in color.items()]
    handles += [Patch(facecolor=c, label=f"{g}: generating") for g, c in color.items()]
    handles.append(Patch(facecolor="none", edgecolor=PREEMPTED_COLOR, hatch="xx", label="preempted"))
    return handles


def plot_priority_timelines(traces: Mapping[str, Trace], groups: Mapping[str, str],
                            height: float = 5.0) -> Figure:
    """:func:`plot_priority_timeline` for several runs of the same workload side by side,
    titled by the keys of ``traces`` (e.g. the scheduling policy), on one time axis and
    with one key under them, so the panels are the same size and a bar's length can be
    compared across them."""
    if not traces:
        raise ValueError("no trace to draw")
    fig = Figure(figsize=(5.5 * len(traces), height), layout="constrained")
    axes = fig.subplots(1, len(traces), sharex=True, squeeze=False)[0]
    for ax, (title, trace) in zip(axes, traces.items()):
        plot_priority_timeline(trace, groups, ax=ax, title=title, legend=False)
    colors = [_group_colors(trace, groups) for trace in traces.values()]
    if any(c != colors[0] for c in colors):
        raise ValueError("the runs' groups arrive in different orders, so their colours would "
                         "differ: draw runs of the same workload")
    fig.legend(handles=_group_handles(colors[0]), loc="outside lower center",
               ncol=3 if len(colors[0]) > 2 else len(colors[0]) * 2 + 1, fontsize=8)
    return fig
