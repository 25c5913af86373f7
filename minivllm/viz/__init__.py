"""Pictures of the engine, drawn from its step trace (every notebook uses them).

Every function here takes a :class:`~minivllm.trace.Trace` (or plain numbers) and an
optional matplotlib ``Axes``, and returns the ``Figure``. None of them runs the engine:
a figure shows exactly what the trace recorded, so re-running a notebook cell redraws
the same run instead of producing a new one. Figures made here have fixed sizes so they
look the same in every notebook and in ``figures/``.

A request keeps one colour in every picture of a trace (:func:`request_colors`: request
``"3"`` always gets the palette's fourth colour; named ids, a server's ``chatcmpl-...``,
take the colours left in order of arrival), so the request that fills blocks 3, 7 and 9
in the block table is the same colour as its bars in the batch composition and its row
in the timeline; each figure carries the key.

    from minivllm import viz
    fig = viz.plot_batch_composition(llm.trace)
    viz.save_figure(fig, "batch_composition")   # shows, in Jupyter, the file it wrote
    viz.plot_steps(llm.trace)    # a few steps side by side: the static replay
    viz.replay(llm.trace)        # step slider + play button in Jupyter

One module per kind of picture (``kv_cache``, ``batch``, ``timeline``, ``latency``,
``steps``, ``architecture``, ``spec_decode``, ``cluster``, ``quantization``, ``disagg``,
``overlap``), with the shared colours and
sizes in ``style`` and :func:`save_figure` in ``saving``; every public name is imported here, so ``viz.NAME``
is all a notebook needs.
"""

from minivllm.viz.architecture import plot_architecture, plot_process_split
from minivllm.viz.batch import plot_batch_composition, plot_flat_batch
from minivllm.viz.cluster import CLUSTER_SWEEP_SIZE, POLICY_COLORS, plot_cluster_sweep
from minivllm.viz.disagg import (
    LAYOUT_COLORS,
    TIER_COLORS,
    ConnectorCall,
    condense_calls,
    plot_connector_calls,
    plot_disagg_layouts,
    plot_goodput_sweep,
    plot_prefill_interference,
    plot_tier_residency,
)
from minivllm.viz.kv_cache import (
    block_owners,
    memory_waste,
    plot_block_table,
    plot_kv_usage,
    plot_memory_waste,
)
from minivllm.viz.latency import plot_latency, plot_ttft_breakdown
from minivllm.viz.overlap import plot_step_overlap, step_overlap
from minivllm.viz.quantization import (
    VARIANT_COLORS,
    plot_channel_maxima,
    plot_decode_bytes,
    plot_kv_scales,
    plot_layer_errors,
    plot_parting_step,
    plot_quantization_tradeoff,
)
from minivllm.viz.saving import FIGURES_ENV, SavedFigure, figures_dir, save_figure
from minivllm.viz.spec_decode import plot_spec_decode, spec_decode_counts
from minivllm.viz.steps import pick_steps, plot_steps, replay
from minivllm.viz.style import (
    ARCHITECTURE_SIZE,
    BATCH_SIZE,
    BLOCK_TABLE_SIZE,
    DECODE_COLOR,
    FEW_SAMPLES,
    FLAT_BATCH_SIZE,
    FREE_COLOR,
    KV_USAGE_SIZE,
    LATENCY_SIZE,
    MAX_KEYED_REQUESTS,
    MEMORY_WASTE_SIZE,
    PREEMPTED_COLOR,
    PREFILL_COLOR,
    PREFILL_HATCH,
    REPLAY_SIZE,
    STEPS_SIZE,
    TIMELINE_SIZE,
    WAITING_COLOR,
    request_color,
    request_colors,
    short_id,
)
from minivllm.viz.timeline import (
    plot_priority_timeline,
    plot_priority_timelines,
    plot_request_timeline,
    request_spans,
)

__all__ = [
    "ARCHITECTURE_SIZE",
    "BATCH_SIZE",
    "BLOCK_TABLE_SIZE",
    "CLUSTER_SWEEP_SIZE",
    "ConnectorCall",
    "DECODE_COLOR",
    "FEW_SAMPLES",
    "FIGURES_ENV",
    "FLAT_BATCH_SIZE",
    "FREE_COLOR",
    "KV_USAGE_SIZE",
    "LAYOUT_COLORS",
    "LATENCY_SIZE",
    "MAX_KEYED_REQUESTS",
    "MEMORY_WASTE_SIZE",
    "POLICY_COLORS",
    "PREEMPTED_COLOR",
    "PREFILL_COLOR",
    "PREFILL_HATCH",
    "REPLAY_SIZE",
    "STEPS_SIZE",
    "SavedFigure",
    "TIER_COLORS",
    "TIMELINE_SIZE",
    "VARIANT_COLORS",
    "WAITING_COLOR",
    "block_owners",
    "condense_calls",
    "figures_dir",
    "memory_waste",
    "pick_steps",
    "plot_architecture",
    "plot_batch_composition",
    "plot_block_table",
    "plot_channel_maxima",
    "plot_cluster_sweep",
    "plot_connector_calls",
    "plot_decode_bytes",
    "plot_disagg_layouts",
    "plot_flat_batch",
    "plot_goodput_sweep",
    "plot_kv_scales",
    "plot_kv_usage",
    "plot_latency",
    "plot_layer_errors",
    "plot_parting_step",
    "plot_prefill_interference",
    "plot_process_split",
    "plot_memory_waste",
    "plot_priority_timeline",
    "plot_priority_timelines",
    "plot_quantization_tradeoff",
    "plot_request_timeline",
    "plot_spec_decode",
    "plot_step_overlap",
    "plot_steps",
    "plot_tier_residency",
    "plot_ttft_breakdown",
    "replay",
    "request_color",
    "request_colors",
    "short_id",
    "request_spans",
    "save_figure",
    "spec_decode_counts",
    "step_overlap",
]
