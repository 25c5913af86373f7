"""Speculative decoding per step: drafts proposed, accepted, rejected, and bonus tokens."""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from minivllm.trace import Trace
from minivllm.viz.style import DECODE_COLOR, KV_USAGE_SIZE, PREEMPTED_COLOR, _new_axes

ACCEPTED_COLOR = "#59a14f"


def spec_decode_counts(trace: Trace) -> dict[str, list[int]]:
    """Per step (``steps``): draft tokens ``proposed`` and ``accepted`` over all requests,
    and ``bonus``: requests whose drafts were all accepted (the target's token then comes
    on top for free)."""
    out: dict[str, list[int]] = {"steps": [], "proposed": [], "accepted": [], "bonus": []}
    for record in trace.steps:
        drafted = [c for c in record.scheduled if c.num_draft_tokens]
        out["steps"].append(record.step)
        out["proposed"].append(sum(c.num_draft_tokens for c in drafted))
        out["accepted"].append(sum(c.num_accepted_tokens for c in drafted))
        out["bonus"].append(sum(c.num_accepted_tokens == c.num_draft_tokens for c in drafted))
    return out


def plot_spec_decode(trace: Trace, ax: Axes | None = None) -> Figure:
    """Bars per step: accepted draft tokens (green) under rejected ones (red, hatched),
    so a bar's height is the drafts proposed; dots: bonus tokens (all of a request's
    drafts accepted), drawn only in steps that gave at least one. A step with no bar ran without drafts (prefills, no match found).
    """
    if not trace.steps:
        raise ValueError("the trace has no steps yet: run the engine (e.g. llm.generate) first")
    fig, ax = _new_axes(ax, KV_USAGE_SIZE)
    c = spec_decode_counts(trace)
    rejected = [p - a for p, a in zip(c["proposed"], c["accepted"])]
    ax.bar(c["steps"], c["accepted"], color=ACCEPTED_COLOR, width=0.9, label="accepted drafts",
           gid="accepted")
    ax.bar(c["steps"], rejected, bottom=c["accepted"], color=PREEMPTED_COLOR, alpha=0.6, hatch="//",
           width=0.9, label="rejected drafts", gid="rejected")
    bonus = [(step, n) for step, n in zip(c["steps"], c["bonus"]) if n]  # steps where some request got one
    ax.scatter([step for step, _ in bonus], [n for _, n in bonus], color=DECODE_COLOR, s=12, zorder=3,
               label="bonus tokens", gid="bonus")
    ax.set_ylim(0, max([*c["proposed"], *c["bonus"], 1]) * 1.15)  # room above the tallest bar
    total, accepted = sum(c["proposed"]), sum(c["accepted"])
    rate = f"{100 * accepted / total:.0f}% accepted" if total else "no drafts"
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"Speculative decoding: {total} draft tokens proposed, {rate}", fontsize=10)
    return fig
