"""Quantization drawn (notebook 15): the bytes a batch-1 decode step reads and the time
they imply, activation outliers per input channel, the rounding error of each scheme per
layer, float32 against int8 side by side, the step at which an int8 model's greedy
text parts from float32's, and the per-layer scales of an 8-bit KV cache.

Like every figure in :mod:`minivllm.viz`, these take numbers and return the Figure; they
never run a model. A measured time (a *spread* below) is anything with ``low``, ``median`` and
``high``, such as a :class:`minivllm.bench.timing.Timing`: the bars show the median, the
whiskers the middle half of the rounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minivllm.viz.style import DECODE_COLOR, PREFILL_COLOR, _new_axes, _new_figure

DECODE_BYTES_SIZE = (11.0, 3.8)
CHANNEL_MAXIMA_SIZE = (10.0, 3.6)
LAYER_ERRORS_SIZE = (10.0, 3.8)
TRADEOFF_SIZE = (13.0, 3.4)
PARTING_SIZE = (8.0, 3.8)
KV_SCALES_SIZE = (10.0, 3.6)
VARIANT_COLORS = {"float32": DECODE_COLOR, "int8": PREFILL_COLOR}
"""float32 and int8 keep one colour in every figure of the notebook (another name gets
the next colour of tab10)."""


def variant_color(name: str, index: int = 0) -> str | tuple[float, float, float]:
    return VARIANT_COLORS.get(name) or plt.get_cmap("tab10").colors[(index + 2) % 10]


def _bars(ax: Axes, names: Sequence[str], values: Sequence[float], fmt: str,
          errors: Sequence[tuple[float, float]] | None = None, gid: str = "") -> None:
    """One bar per variant in its colour, its value written above it (above the whisker
    where there is one), with room left above the tallest for the text."""
    colors = [variant_color(n, i) for i, n in enumerate(names)]
    yerr = None if errors is None else [[lo for lo, _ in errors], [hi for _, hi in errors]]
    ax.bar(range(len(names)), values, color=colors, width=0.6, yerr=yerr, capsize=4,
           error_kw=dict(elinewidth=1, ecolor="0.2"), gid=gid)
    tops = [v + (0 if errors is None else errors[i][1]) for i, v in enumerate(values)]
    for i, (v, top) in enumerate(zip(values, tops)):
        ax.text(i, top, fmt.format(v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(0, max(tops) * 1.22 if max(tops) > 0 else 1)


def _whiskers(t: object) -> tuple[float, float]:
    return t.median - t.low, t.high - t.median


def plot_decode_bytes(names: Sequence[str], weight_bytes: Sequence[int], bandwidth_gb_s: object,
                      step_ms: Sequence[object], ax: Sequence[Axes] | None = None) -> Figure:
    """Left: the megabytes of linear-layer weights one batch-1 decode step reads, per
    variant. Right: per variant, the least time memory can deliver them in
    (bytes / bandwidth: the bar at the median bandwidth, the whisker over the middle half
    of its rounds) beside the measured time of a decode step (median, middle half).

    What it shows: a batch-1 decode step multiplies one row by every weight, so it must
    read every weight once; the bandwidth floor falls with the bytes. How close the
    measured step comes to its floor says how much of the step the weight reads explain.
    ``bandwidth_gb_s``: a spread in GB/s (10^9 bytes per second); ``step_ms``: a spread in
    milliseconds per variant."""
    if not names or not (len(names) == len(weight_bytes) == len(step_ms)):
        raise ValueError("give one weight size and one step time per variant")
    if ax is None:
        fig = _new_figure(DECODE_BYTES_SIZE)
        left, right = fig.subplots(1, 2, width_ratios=(1, 1.6))
    else:
        left, right = list(ax)
        fig = left.figure
    _bars(left, names, [b / 1e6 for b in weight_bytes], "{:.0f} MB", gid="weight_mb")
    left.set_ylabel("MB of weights read per step")
    left.set_title("What one batch-1 decode step reads", fontsize=10)
    width = 0.38
    for i, (name, nbytes, step) in enumerate(zip(names, weight_bytes, step_ms)):
        floor = nbytes / (bandwidth_gb_s.median * 1e9) * 1e3
        low, high = nbytes / (bandwidth_gb_s.high * 1e9) * 1e3, nbytes / (bandwidth_gb_s.low * 1e9) * 1e3
        color = variant_color(name, i)
        right.bar(i - width / 2, floor, width, color=color, alpha=0.35, hatch="//", edgecolor=color,
                  yerr=[[floor - low], [high - floor]], capsize=3, gid=f"floor:{name}")
        right.bar(i + width / 2, step.median, width, color=color, yerr=[[step.median - step.low], [step.high - step.median]],
                  capsize=3, gid=f"measured:{name}")
        right.text(i - width / 2, high, f"{floor:.1f}", ha="center", va="bottom", fontsize=8)
        right.text(i + width / 2, step.high, f"{step.median:.1f}", ha="center", va="bottom", fontsize=8)
    top = max(max(s.high for s in step_ms), max(b / (bandwidth_gb_s.low * 1e9) * 1e3 for b in weight_bytes))
    right.set_ylim(0, top * 1.22)
    right.set_xticks(range(len(names)), names)
    right.set_ylabel("ms per decode step")
    right.set_title(f"Bytes / bandwidth ({bandwidth_gb_s.median:.0f} GB/s) against the measured step",
                    fontsize=10)
    right.legend(handles=[Patch(facecolor="0.8", hatch="//", edgecolor="0.4", label="floor: weight bytes / bandwidth"),
                          Patch(facecolor="0.4", label="measured decode step (median, middle half)")],
                 fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    return fig


def plot_channel_maxima(first_token: Sequence[float], other_tokens: Sequence[float], title: str,
                        ax: Axes | None = None) -> Figure:
    """The largest ``|x|`` in each input channel of one layer's activations, on a log
    axis: the first token of the prompt alone, and the largest over every other token.

    What it shows: a handful of channels (and, in some layers, the first token) run
    hundreds or thousands of times larger than the rest. One scale for all of them sets
    the rounding step by the largest value, and every ordinary value falls below it."""
    if len(first_token) != len(other_tokens) or not len(first_token):
        raise ValueError("give one maximum per channel for the first token and for the others")
    fig, ax = _new_axes(ax, CHANNEL_MAXIMA_SIZE)
    channels = range(len(first_token))
    ax.semilogy(channels, other_tokens, ".", ms=3, color=DECODE_COLOR, label="largest |x| over the other tokens",
                gid="other_tokens")
    ax.semilogy(channels, first_token, ".", ms=3, color=PREFILL_COLOR, label="the first token", gid="first_token")
    ax.set_xlabel("input channel")
    ax.set_ylabel("largest |x| (log)")
    ax.set_xlim(-10, len(first_token) + 10)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, markerscale=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    return fig


def plot_layer_errors(errors: Mapping[str, Sequence[float]], highlight: int | None = None,
                      ax: Axes | None = None) -> Figure:
    """One line per quantization scheme: the relative error of a layer's output (each
    token's ``|y_q - y| / |y|``, the median over the tokens) for layer 0, 1, 2, ..., on a
    log axis. ``highlight``: a layer to mark with a dotted line (the one looked at
    closely)."""
    if not errors:
        raise ValueError("no errors to draw")
    fig, ax = _new_axes(ax, LAYER_ERRORS_SIZE)
    markers = "os^Dv"
    for k, (name, values) in enumerate(errors.items()):
        ax.semilogy(range(len(values)), [max(v, 1e-6) for v in values], marker=markers[k % len(markers)], ms=4,
                    color=plt.get_cmap("tab10").colors[k % 10], label=name, gid=f"errors:{name}")
    if highlight is not None:
        ax.axvline(highlight, color="0.5", linestyle=":", linewidth=1)
    n = max(len(v) for v in errors.values())
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the output\n(median over tokens, log)")
    ax.set_title("Rounding error of each scheme, layer by layer" +
                 ("" if highlight is None else f" (dotted: layer {highlight})"), fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(errors), 4))
    return fig


def plot_quantization_tradeoff(names: Sequence[str], weight_bytes: Sequence[int], decode_tok_s: Sequence[object],
                               batch_tok_s: Sequence[object], perplexity: Sequence[float],
                               answers: Sequence[tuple[int, int]], batch_label: str = "a batch",
                               ax: Sequence[Axes] | None = None) -> Figure:
    """Five panels, one bar per variant in each: the linear weights (MB), batch-1 decode
    output tokens per second, the same for a batch of requests (both spreads: the median
    with the middle half), perplexity (lower is better), and the short questions answered right.
    Speed and memory on the left, quality on the right: what the bytes buy and what the
    rounding costs, on one line."""
    n = len(names)
    if not n or not all(len(x) == n for x in (weight_bytes, decode_tok_s, batch_tok_s, perplexity, answers)):
        raise ValueError("give one value per variant in every panel")
    if ax is None:
        fig = _new_figure(TRADEOFF_SIZE)
        axes = list(fig.subplots(1, 5))
    else:
        axes = list(ax)
        fig = axes[0].figure
    _bars(axes[0], names, [b / 1e6 for b in weight_bytes], "{:.0f}", gid="weight_mb")
    axes[0].set_title("linear weights (MB)", fontsize=9)
    _bars(axes[1], names, [t.median for t in decode_tok_s], "{:.1f}", [_whiskers(t) for t in decode_tok_s],
          gid="decode")
    axes[1].set_title("batch-1 decode (tok/s)", fontsize=9)
    _bars(axes[2], names, [t.median for t in batch_tok_s], "{:.0f}", [_whiskers(t) for t in batch_tok_s],
          gid="batch")
    axes[2].set_title(f"{batch_label} (output tok/s)", fontsize=9)
    _bars(axes[3], names, list(perplexity), "{:.2f}", gid="perplexity")
    axes[3].set_title("perplexity (lower is better)", fontsize=9)
    _bars(axes[4], names, [right for right, _ in answers], "{:.0f}", gid="answers")
    axes[4].set_title(f"questions right (of {max(total for _, total in answers)})", fontsize=9)
    for a in axes:
        a.tick_params(labelsize=8)
    return fig


def plot_parting_step(tokens: Sequence[str], probabilities: Mapping[str, Sequence[float]],
                      chosen: Mapping[str, str], title: str = "The step where the greedy texts part",
                      ax: Axes | None = None) -> Figure:
    """The candidate next tokens at one step (rows) and the probability each variant gives
    them (one bar per variant), each variant's greedy choice outlined in black.

    What it shows: where two tokens are nearly tied, a small change in the logits
    (rounding) is enough to swap which one is largest, and greedy decoding then follows a
    different text from there on."""
    if not tokens or any(len(p) != len(tokens) for p in probabilities.values()):
        raise ValueError("give one probability per token for every variant")
    fig, ax = _new_axes(ax, PARTING_SIZE)
    height = 0.8 / max(len(probabilities), 1)
    for k, (name, probs) in enumerate(probabilities.items()):
        y = [i + (k - (len(probabilities) - 1) / 2) * height for i in range(len(tokens))]
        edges = ["black" if tok == chosen.get(name) else "none" for tok in tokens]
        ax.barh(y, probs, height * 0.95, color=variant_color(name, k), edgecolor=edges, linewidth=1.8,
                label=name, gid=f"probabilities:{name}")
    ax.set_yticks(range(len(tokens)), [repr(t) for t in tokens], fontsize=9)
    ax.set_ylim(len(tokens) - 0.5, -0.5)  # the most likely on top
    ax.set_xlim(0, max(max(p) for p in probabilities.values()) * 1.1)
    ax.set_xlabel("probability of the next token")
    ax.set_title(title, fontsize=10)
    handles = [Patch(facecolor=variant_color(name, k), label=name) for k, name in enumerate(probabilities)]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.8, label="each one's greedy choice"))
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(handles))
    return fig


def plot_kv_scales(k_scales: Sequence[float], v_scales: Sequence[float], landing: float | None = None,
                   ax: Axes | None = None) -> Figure:
    """An 8-bit KV cache's two scales per layer (vLLM's ``k_scale`` and ``v_scale``: a
    cached number times its layer's scale is the key or value), for layer 0, 1, 2, ... on a
    log axis. ``landing``: the fp8 number the largest calibration value is stored as (the
    fp8 range over the headroom); given, a second axis on the right reads each scale as that
    largest value (scale x landing).

    What it shows: keys and values differ in size from layer to layer and from each other,
    which is why each layer gets its own pair of scales rather than one for the model."""
    if not len(k_scales) or len(k_scales) != len(v_scales):
        raise ValueError("give one key scale and one value scale per layer")
    fig, ax = _new_axes(ax, KV_SCALES_SIZE)
    layers = range(len(k_scales))
    ax.semilogy(layers, k_scales, "o-", ms=4, color=DECODE_COLOR, label="k_scale (keys)", gid="k_scale")
    ax.semilogy(layers, v_scales, "s-", ms=4, color=PREFILL_COLOR, label="v_scale (values)", gid="v_scale")
    ax.set_xlim(-0.5, len(k_scales) - 0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("scale (log)")
    if landing:
        right = ax.secondary_yaxis("right", functions=(lambda s: s * landing, lambda m: m / landing))
        right.set_ylabel(f"largest |value| at calibration\n(stored as {landing:g})")
    ax.set_title("The 8-bit KV cache's scales, layer by layer", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    return fig
