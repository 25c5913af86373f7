"""A few steps side by side (the static replay) and the interactive replay widget."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from matplotlib.figure import Figure

from minivllm.trace import Trace
from minivllm.viz.batch import plot_batch_composition
from minivllm.viz.kv_cache import _blocks_shown, plot_block_table
from minivllm.viz.style import REPLAY_SIZE, STEPS_SIZE, _get_step, _new_figure, short_id

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
        parts = [f"{short_id(c.request_id)}:{'P' if c.is_prefill else 'D'}{c.num_new_tokens}"
                 for c in record.scheduled[:8]]
        more = " ..." if len(record.scheduled) > 8 else ""
        ran = textwrap.fill("this step ran " + " ".join(parts) + more, 90)  # two lines at most
        pool_ax.set_title(f"{letter}: KV block pool after step {record.step} "
                          f"({record.num_free_blocks}/{record.num_blocks} blocks free)\n{ran}", fontsize=8)
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
    parts = [f"{short_id(c.request_id)}: {'prefill' if c.is_prefill else 'decode'} {c.num_new_tokens}"
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
