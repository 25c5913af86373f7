"""Shared look of every picture: the colours of the phases, a colour per request and its
key, the fixed figure sizes, and the small helpers every drawing module uses."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.patches import Patch

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

_TAB20 = plt.get_cmap("tab20").colors
_PALETTE = tuple(_TAB20[i] for i in range(0, 20, 2) if i != 14) + tuple(_TAB20[i] for i in range(1, 20, 2) if i != 15)
"""tab20's strong shades, then its light ones, without its two greys (entries 14 and 15):
grey already means a free block and a waiting request. 18 colours."""


def request_color(request_id: str) -> tuple[float, float, float]:
    """A stable colour per request id: the same in every figure and every run.

    Numeric ids (what ``LLM.generate`` assigns) walk the palette in order, so the first
    eighteen requests get eighteen different colours; other ids are hashed (crc32, which,
    unlike Python's ``hash`` of a string, does not change between processes), so two of
    them can share a colour.
    """
    key = int(request_id) if request_id.isdigit() else zlib.crc32(request_id.encode())
    return _PALETTE[key % len(_PALETTE)]


def request_colors(request_ids: Iterable[str]) -> dict[str, tuple[float, float, float]]:
    """A colour for each of these requests, all different up to 18 requests: numeric ids
    keep :func:`request_color`'s; other ids (a server's ``chatcmpl-...``, whose hashes
    would collide) take the colours left over, in the order given."""
    ids = list(dict.fromkeys(request_ids))
    colors = {r: request_color(r) for r in ids if r.isdigit()}
    left = [c for c in _PALETTE if c not in set(colors.values())] or list(_PALETTE)
    named = [r for r in ids if not r.isdigit()]
    colors.update({r: left[k % len(left)] for k, r in enumerate(named)})
    return colors


def trace_colors(trace: Trace) -> dict[str, tuple[float, float, float]]:
    """:func:`request_colors` for every request of a trace, in order of arrival, so that
    all figures of one trace agree."""
    scheduled = (c.request_id for record in trace.steps for c in record.scheduled)
    return request_colors([*trace.requests, *scheduled])


def short_id(request_id: str, width: int = 12) -> str:
    """A request id as figures print it: whole up to ``width`` characters, else its first
    three and its last characters (a server's ids are 40 characters, ``chatcmpl-`` and
    random hex: the end tells them apart; a title of eight whole ones would be wider than
    any screen)."""
    if len(request_id) <= width:
        return request_id
    return f"{request_id[:3]}…{request_id[-(width - 4):]}"


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


def _set_row_limits(ax: Axes, num_rows: int, source: str | None) -> None:
    """Rows top to bottom (the first on top), with room under the last one for
    :func:`_note_time_source`'s note when there is one, so it never sits on the last
    rows' bars."""
    ax.set_ylim(num_rows - 0.5 + (0.08 * num_rows if source else 0), -0.5)


def _note_time_source(ax: Axes, source: str | None) -> None:
    """Times that are not this machine's wall clock say where they came from (a
    simulated run names its cost model, ``Trace.time_source``), in the axes' corner."""
    if source:
        ax.text(0.995, 0.015, f"times: {source}", transform=ax.transAxes, ha="right",
                va="bottom", fontsize=7, color="0.25",
                bbox=dict(facecolor="white", alpha=0.8, linewidth=0, pad=1.5))


def _get_step(trace: Trace, step: int) -> StepRecord:
    if not trace.steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    try:
        return trace.steps[step]
    except IndexError:
        raise IndexError(f"step {step} is out of range: the trace holds {len(trace.steps)} steps") from None


def _request_key(ax: Axes, request_ids: Sequence[str], below: bool = False,
                 colors: dict[str, tuple[float, float, float]] | None = None) -> None:
    """The key from colour to request (``colors``, default :func:`request_colors`): beside
    the axes, or ``below`` it (a note instead when there are too many requests to name)."""
    ids = list(dict.fromkeys(request_ids))
    colors = colors if colors is not None else request_colors(ids)
    if not ids:
        return
    if len(ids) > MAX_KEYED_REQUESTS:
        ax.text(0.0 if below else 1.01, -0.02 if below else 1.0,
                f"colour = request ({len(ids)} requests)", transform=ax.transAxes, fontsize=7,
                va="top")
        return
    handles = [Patch(facecolor=colors.get(r, request_color(r)), label=short_id(r)) for r in ids]
    if below:
        place = dict(loc="upper left", bbox_to_anchor=(0.0, 0.0), ncol=min(len(ids), 12))
    else:
        place = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 if len(ids) <= 12 else 2)
    # An extra legend artist (not ax.legend) so that the axes keeps its own legend slot
    # for the style key (prefill / decode / budget) beside it.
    key = Legend(ax, handles, [h.get_label() for h in handles], title="request (colour)",
                 fontsize=7, title_fontsize=7, handlelength=1.0, borderaxespad=0.0,
                 columnspacing=0.8, **place)
    ax.add_artist(key)
    # add_artist clips an artist to the axes, and layouts and bbox_inches="tight" leave
    # out what is clipped to the axes: a key outside them would be cut off the picture.
    key.set_clip_on(False)
