"""A cluster sweep drawn: prefix-cache hit rate and time to first token against the
number of replicas, one line per routing policy (:func:`minivllm.sim.cluster_simulator.sweep`)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from minivllm.sim.cluster_simulator import SweepRow
from minivllm.viz.style import _new_figure, _note_time_source

CLUSTER_SWEEP_SIZE = (10.0, 4.0)
POLICY_COLORS = {"round_robin": "#e15759", "least_outstanding": "#4e79a7", "prefix_aware": "#59a14f"}
"""One colour per routing policy (another policy gets the next colour of tab10)."""


def _policy_color(policy: str, index: int) -> tuple[float, float, float] | str:
    return POLICY_COLORS.get(policy) or plt.get_cmap("tab10").colors[index % 10]


def plot_cluster_sweep(rows: Sequence[SweepRow], ax: Sequence[Axes] | None = None,
                       time_source: str | None = None) -> Figure:
    """Left: the cluster's prefix-cache hit rate; right: mean TTFT (solid) and p99 TTFT
    (dashed), in milliseconds; both against the number of replicas (a log-2 axis), one
    colour per routing policy.

    What it shows: with one replica every policy is the same engine. As replicas are
    added, a cache-blind router spreads the questions about one document over several
    replicas, each of which computes the document again, so its hit rate falls; a
    prefix-aware router keeps them together and its hit rate holds, which shows in the
    time to first token (less prompt to compute). ``rows``: the
    :class:`~minivllm.sim.cluster_simulator.SweepRow` list of a sweep (anything with
    ``policy``, ``num_replicas``, ``hit_rate``, ``mean_ttft``, ``p99_ttft``). Pass two
    Axes to draw into your own layout. ``time_source`` (e.g. the cost model's label) is
    noted in the corner, since the seconds are simulated.
    """
    if not rows:
        raise ValueError("no sweep rows to draw: run minivllm.sim.cluster_simulator.sweep first")
    if ax is None:
        fig = _new_figure(CLUSTER_SWEEP_SIZE)
        axes = list(fig.subplots(1, 2))
    else:
        axes = list(ax)
        if len(axes) != 2:
            raise ValueError(f"pass two Axes (hit rate, TTFT), got {len(axes)}")
        fig = axes[0].figure
    hit_ax, ttft_ax = axes
    policies = list(dict.fromkeys(r.policy for r in rows))
    for k, policy in enumerate(policies):
        mine = sorted((r for r in rows if r.policy == policy), key=lambda r: r.num_replicas)
        x = [r.num_replicas for r in mine]
        color = _policy_color(policy, k)
        hit_ax.plot(x, [100 * r.hit_rate for r in mine], "o-", color=color, label=policy,
                    gid=f"hit_rate:{policy}")
        ttft_ax.plot(x, [1e3 * r.mean_ttft for r in mine], "o-", color=color, label=f"{policy} mean",
                     gid=f"mean_ttft:{policy}")
        ttft_ax.plot(x, [1e3 * r.p99_ttft for r in mine], "s--", color=color, alpha=0.7,
                     label=f"{policy} p99", gid=f"p99_ttft:{policy}")
    counts = sorted({r.num_replicas for r in rows})
    for a in axes:
        a.set_xscale("log", base=2)
        a.set_xticks(counts, labels=[str(c) for c in counts])
        a.minorticks_off()
        a.set_xlabel("replicas")
        a.grid(alpha=0.3)
    hit_ax.set_ylim(0, 100)
    hit_ax.set_ylabel("prefix-cache hit rate (%)")
    hit_ax.set_title("Cluster hit rate (all replicas' hits / queries)", fontsize=10)
    hit_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(policies))  # under the panel, as on the right
    ttft_ax.set_ylim(bottom=0)
    ttft_ax.set_ylabel("time to first token (ms)")
    ttft_ax.set_title("TTFT: mean (solid), p99 (dashed)", fontsize=10)
    # Below the axes: the p99 lines of a cache-blind policy run along the top, where any
    # corner inside would cover them.
    ttft_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(policies))
    _note_time_source(ttft_ax, time_source)
    return fig
