"""Where the engine's own work sits against the model's, step by step (async scheduling).

Each step record says when it was scheduled, when its forward pass ran and when its
output was processed (:class:`~minivllm.trace.StepTimes`). Drawn as two lanes on one
time axis, a step at a time, one engine does one thing after another (the model lane
has a gap wherever the engine works) and the other, with ``async_scheduling=True``,
schedules step N+1 and processes step N-1 while step N's forward pass runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from minivllm.trace import StepRecord, Trace
from minivllm.viz.style import DECODE_COLOR, KV_USAGE_SIZE, PREFILL_COLOR, _new_axes

MODEL_COLOR = DECODE_COLOR
SCHEDULE_COLOR = PREFILL_COLOR
OUTPUT_COLOR = "#76b7b2"


def step_intervals(record: StepRecord) -> dict[str, tuple[float, float]]:
    """A step's intervals, (start, end) in seconds on the engine's clock: ``schedule``
    (scheduling it), ``model`` (its forward pass and sampling) and ``output``
    (processing its tokens). Packing its inputs is in none of them."""
    times = record.times
    if times is None or times.model_start is None:
        raise ValueError(f"step {record.step} has no timings (a step that only preempted, or a "
                         "simulated one): nothing ran")
    return {"schedule": (record.start, times.scheduled),
            "model": (times.model_start, times.model_start + record.model_time),
            "output": (times.output_start, record.end)}


def _overlap(a: tuple[float, float], spans: Sequence[tuple[float, float]]) -> float:
    """Seconds of interval ``a`` covered by the (disjoint) ``spans``."""
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def step_overlap(trace: Trace, steps: Sequence[int] | None = None) -> dict[str, float]:
    """Over the steps with timings (``steps``: their indices in the trace, default all):
    seconds of ``engine`` work (scheduling and output processing), of ``model`` work,
    and how much of the engine's ran while the model ran (``hidden``), with its share
    ``hidden_fraction``."""
    return _overlap_of(_timed(trace, steps))


def _timed(trace: Trace, steps: Sequence[int] | None) -> list[StepRecord]:
    """The steps (indices into the trace, default all) whose forward pass has timings."""
    records = [r for r in (trace.steps if steps is None else [trace.steps[i] for i in steps])
               if r.times is not None and r.times.model_start is not None]
    if not records:
        raise ValueError("no step with timings in the trace: run the engine (e.g. llm.generate) first")
    return records


def _overlap_of(records: Sequence[StepRecord]) -> dict[str, float]:
    parts = [step_intervals(r) for r in records]
    model = [p["model"] for p in parts]
    engine = [p[k] for p in parts for k in ("schedule", "output")]
    engine_s = sum(b - a for a, b in engine)
    hidden = sum(_overlap(e, model) for e in engine)
    return {"engine": engine_s, "model": sum(b - a for a, b in model), "hidden": hidden,
            "hidden_fraction": hidden / engine_s if engine_s else 0.0}


def plot_step_overlap(trace: Trace, steps: Sequence[int] | None = None, ax: Axes | None = None,
                      title: str | None = None) -> Figure:
    """Two lanes over time (ms from the first step shown): the model's forward passes,
    and the engine's scheduling and output processing, each bar wide enough labelled
    with its step. ``steps``: indices into the trace (default: the first eight with
    timings). The engine's bars are where its work ran, as the wall clock saw it: with
    async scheduling on a CPU, mostly just before the forward pass it was meant to hide
    behind (its thread takes the interpreter lock when the model's thread first lets it
    go; notebook 11)."""
    records = _timed(trace, steps)
    if steps is None:
        records = records[:8]
    fig, ax = _new_axes(ax, KV_USAGE_SIZE)
    t0 = min(r.start for r in records)
    lanes = {"model": 1, "schedule": 0, "output": 0}
    colors = {"model": MODEL_COLOR, "schedule": SCHEDULE_COLOR, "output": OUTPUT_COLOR}
    labels = {"model": "forward pass + sampling", "schedule": "scheduling", "output": "processing the output"}
    span = (max(r.end for r in records) - t0) * 1e3
    drawn = set()
    for r in records:
        for kind, (a, b) in step_intervals(r).items():
            x, w = (a - t0) * 1e3, (b - a) * 1e3
            ax.broken_barh([(x, w)], (lanes[kind] - 0.35, 0.7), color=colors[kind], edgecolor="white",
                           label=None if kind in drawn else labels[kind], gid=f"{kind}-{r.step}")
            drawn.add(kind)
            if w > span / 25:  # room for the number
                ax.text(x + w / 2, lanes[kind], str(r.step), ha="center", va="center", fontsize=7,
                        color="white" if kind == "model" else "black", clip_on=True)
    shown = _overlap_of(records)
    ax.set_yticks([0, 1], ["engine", "model"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlabel("ms since the first step shown (each bar: its step's number)")
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    ax.set_title(title or f"{100 * shown['hidden_fraction']:.0f}% of the engine's own time ran while "
                 f"the model ran ({len(records)} steps)", fontsize=10)
    return fig
