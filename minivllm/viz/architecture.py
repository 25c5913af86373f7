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
    "llm": ("LLM: generate / chat / stream\n(the offline API)", "minivllm/entrypoints/llm.py", "00", 2.0, 7.0),
    "server": ("API server process: HTTP, validation,\ntokenize, detokenize, stream",
               "minivllm/entrypoints/openai/api_server.py\nminivllm/engine/core_client.py", "10", 2.0, 4.8),
    "detokenizer": ("Detokenizer: tokens -> text\nstop strings, streamed pieces",
                    "minivllm/engine/detokenizer.py", "00 10", 2.0, 2.6),
    "engine": ("Engine core: the step loop\nschedule, run, update, outputs",
               "minivllm/engine/core.py\nminivllm/engine/llm_engine.py", "04 09 10", 6.6, 7.0),
    "scheduler": ("Scheduler: who runs this step\ntoken budget, chunks, preemption",
                  "minivllm/core/scheduler.py", "04 06 08", 11.2, 7.0),
    "kv": ("KV cache manager + block pool\nblock tables, free queue, prefix hashes",
           "minivllm/core/kv_cache_manager.py\nminivllm/core/block_pool.py", "03 07", 11.2, 4.8),
    "runner": ("Model runner: one flat batch\ninput_ids, positions, slot_mapping",
               "minivllm/worker/model_runner.py", "04 05", 6.6, 4.8),
    "attention": ("Model (transformers), its attention:\nthe paged attention kernel",
                  "minivllm/worker/attention.py\nminivllm/kernels/ (reference, Triton)", "05", 6.6, 2.6),
    "sampler": ("Sampler: logits -> next token\ngreedy, temperature, top-k/p",
                "minivllm/sample/sampler.py", "00 12 13", 6.6, 0.4),
}
# (from, to, label, arc): the arrows, in the order one request travels.
_ARCHITECTURE_FLOW = [
    ("llm", "engine", "add_request", 0.0), ("server", "engine", "token ids, aborts", 0.0),
    ("engine", "scheduler", "1 schedule()", 0.0), ("scheduler", "kv", "allocate / free blocks", 0.0),
    ("engine", "runner", "2 execute", 0.0), ("runner", "attention", "forward", 0.0),
    ("attention", "sampler", "logits", 0.0), ("sampler", "engine", "3 new tokens", 0.2),
    ("engine", "detokenizer", "4 new token ids,\neach step", 0.0), ("detokenizer", "server", "stream", 0.0),
    ("detokenizer", "llm", "RequestOutput", -0.2),
]
# Arrows whose straight centre-to-centre line would cut the corner of a box in between:
# (from, to) -> (start, end, label centre), in the axes' units.
_ARCHITECTURE_PORTS = {
    ("server", "engine"): ((3.8, 5.25), (4.8, 6.6), (4.3, 5.95)),
    ("engine", "detokenizer"): ((5.1, 6.25), (3.8, 3.0), (3.9, 3.62)),
}
# The boundary of the engine core process of ``minivllm serve`` (x0, y0, x1, y1): the
# scheduler, KV cache manager, model runner and step loop; the API server stays outside.
_ENGINE_CORE_PROCESS = (4.55, -0.55, 13.25, 7.95)


def plot_architecture(ax: Axes | None = None) -> Figure:
    """The engine's parts and the path one request takes through them, each box naming
    the module that implements it and the notebooks that teach it (notebook 00).

    A request enters through the offline ``LLM`` or the HTTP server, the engine core
    runs steps: the scheduler picks this step's tokens (and asks the KV cache manager
    for blocks), the model runner packs them into one flat batch for the model, whose
    attention reads and writes the paged cache, the sampler picks each next token, and
    the detokenizer turns tokens into text for the caller. ``minivllm serve`` runs the
    parts inside the dashed border (scheduler, KV cache manager, model runner, the step
    loop) in an engine core process of their own; the API server process keeps HTTP,
    validation, tokenization, detokenization and streaming, and sends token ids and
    aborts across (notebook 10). The same picture as vLLM's V1 engine, with vLLM's names.
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
    x0, y0, x1, y1 = _ENGINE_CORE_PROCESS
    core = FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0.05", fill=False,
                          edgecolor="#1f4e79", linestyle="--", linewidth=1.2)
    core.set_gid("process:engine_core")
    ax.add_patch(core)
    ax.text(x1 - 0.1, y0 + 0.1, "engine core process (minivllm serve):\nonly token ids and "
            "aborts cross\nits border, one output per step", ha="right", va="bottom",
            fontsize=7.5, color="#1f4e79", style="italic")
    for a, b, label, arc in _ARCHITECTURE_FLOW:
        (x0, y0), (x1, y1) = centres[a], centres[b]
        ha = "center"
        if (a, b) in _ARCHITECTURE_PORTS:
            start, end, mid = _ARCHITECTURE_PORTS[a, b]
        elif arc:  # around the side of the boxes in between: leave and enter sideways
            side = (w / 2 + 0.05) * (1 if arc > 0 else -1)
            start, end = (x0 + side, y0), (x1 + side, y1 - 0.3)
            # a quadratic curve bulges by half its control point's offset, rad x length
            mid = (start[0] + 0.5 * arc * abs(end[1] - start[1]), (start[1] + end[1]) / 2)
            # the label sits outside the bulge, clear of the boxes the curve goes around
            mid, ha = (mid[0] + (0.08 if arc > 0 else -0.08), mid[1]), ("left" if arc > 0 else "right")
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
        ax.text(*mid, label, ha=ha, va="center", fontsize=7.5, color="#8b2f00",
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=0.5))
    ax.set_xlim(-1.2, 13.4)
    ax.set_ylim(-0.7, 8.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("minivllm, one engine step: the parts, their modules (blue), the notebooks "
                 "that teach them (nb), and the numbered path of a step", fontsize=10)
    return fig


# -- the two processes of minivllm serve, and what crosses between them -------------------

# (title, module, what it does): the two sides of plot_process_split.
_PROCESSES = {
    "api_server": ("API server process", "minivllm/entrypoints/openai/api_server.py\nminivllm/engine/async_llm.py\nminivllm/engine/mp_client.py",
                   ["HTTP (FastAPI, uvicorn), API key, limits", "validation: 400 before the core",
                    "chat template, tokenize", "output processor: text, stop strings",
                    "SSE stream; abort on client disconnect"]),
    "engine_core": ("Engine core process", "minivllm/engine/core_proc.py\nminivllm/engine/core.py",
                    ["step loop: read messages, step, send", "scheduler: token budget, chunks",
                     "KV cache manager, block pool", "model runner, attention, sampler",
                     "never waits on a client"]),
}
# (from, to, message, what it carries): the arrows, one ZeroMQ socket each way.
_PROCESS_MESSAGES = [
    ("api_server", "engine_core", "AddRequest", "prompt token ids, SamplingParams"),
    ("api_server", "engine_core", "Abort", "request ids, applied between two steps"),
    ("api_server", "engine_core", "FinishRequests", "requests a stop string ended"),
    ("engine_core", "api_server", "StepOutputs", "each request's new token ids, finish\n"
     "reasons, scheduler gauges: one per step"),
]


def plot_process_split(ax: Axes | None = None) -> Figure:
    """The two processes of ``minivllm serve`` and the messages between them (notebook 10).

    The API server process does everything a client touches (HTTP, validation,
    tokenization, detokenization, streaming); the engine core process runs only the step
    loop, with the scheduler, the KV cache manager and the model runner. They share no
    interpreter lock: the server's JSON work for every streamed token no longer takes
    time from the model. Only small msgpack messages cross, token ids both ways and never
    text (the server's output processor finds stop strings and says so with
    ``FinishRequests``): vLLM V1's ``AsyncMPClient`` and ``EngineCoreProc``.
    """
    fig, ax = _new_axes(ax, (11.0, 5.0))
    w, h, xs = 4.2, 4.2, {"api_server": 2.3, "engine_core": 9.7}
    for key, (title, module, duties) in _PROCESSES.items():
        x = xs[key]
        box = FancyBboxPatch((x - w / 2, 0.2), w, h, boxstyle="round,pad=0.08",
                             facecolor="#f4f1e8", edgecolor="#555555", linewidth=1.0)
        box.set_gid(f"process:{key}")
        ax.add_patch(box)
        ax.text(x, 0.2 + h - 0.3, title, ha="center", va="center", fontsize=11, fontweight="bold")
        ax.text(x, 0.2 + h - 0.85, module, ha="center", va="center", fontsize=8,
                family="monospace", color="#1f4e79")
        for i, duty in enumerate(duties):
            ax.text(x - w / 2 + 0.25, 0.2 + h - 1.6 - 0.55 * i, "- " + duty, ha="left",
                    va="center", fontsize=8.5)
    for i, (a, b, message, carries) in enumerate(_PROCESS_MESSAGES):
        y = 3.8 - 0.95 * i
        start = xs[a] + (w / 2 + 0.1) * (1 if xs[b] > xs[a] else -1)
        end = xs[b] - (w / 2 + 0.1) * (1 if xs[b] > xs[a] else -1)
        arrow = ax.annotate("", xy=(end, y), xytext=(start, y),
                            arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.4))
        arrow.set_gid(f"message:{message}")
        ax.text((start + end) / 2, y + 0.15, message, ha="center", va="bottom", fontsize=9,
                fontweight="bold", color="#8b2f00")
        ax.text((start + end) / 2, y - 0.12, carries, ha="center", va="top", fontsize=7.5,
                color="#8b2f00")
    ax.text(6.0, -0.05, "two ZeroMQ sockets, msgpack (msgspec)", ha="center", va="top",
            fontsize=8, style="italic", color="#555555")
    ax.set_xlim(-0.1, 12.1)
    ax.set_ylim(-0.45, 4.7)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("minivllm serve: two processes, and what crosses between them (token ids, "
                 "never text)", fontsize=10)
    return fig
