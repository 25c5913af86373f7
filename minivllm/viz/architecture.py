"""The engine's parts, each box naming the module that holds it (notebook 00)."""

from __future__ import annotations

import math

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from minivllm.viz.style import ARCHITECTURE_SIZE, _new_axes

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
