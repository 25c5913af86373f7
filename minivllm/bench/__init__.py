"""Benchmarks: minivllm against the tools a reader would otherwise use, on the same requests.

Every performance sentence in a notebook is one of these functions, re-runnable from
the command line as ``minivllm bench MODE`` (:mod:`minivllm.bench.cli`). One module per
mode, as in vLLM's ``vllm/benchmarks/``:

- ``throughput`` (:mod:`.throughput`, tools in :mod:`.tools`): one offline workload
  served by minivllm, by transformers ``generate()`` one request at a time, by padded
  static batches and by transformers' own continuous batching; greedy outputs compared
  token by token; the engine's overhead outside the model forward (notebooks 02, 09).
- ``latency`` (:mod:`.latency`): TTFT, ITL and end-to-end latency against the request
  rate, on the real engine or the simulator; the ITL spike a long prompt causes with
  chunked prefill off and on (notebooks 06, 09).
- ``memory`` (:mod:`.memory`): paged blocks against a contiguous reservation, by
  arithmetic on the workload (notebook 03).
- ``prefix`` (:mod:`.prefix_caching`): the same workload with prefix caching on and off
  (notebook 07).
- ``priority`` (:mod:`.priority`): interactive chat requests at a steady rate while a
  batch job floods the queue, under ``scheduling_policy`` "fcfs" and "priority":
  interactive TTFT p50/p99 and batch throughput.
- ``linear`` (:mod:`.linear`): the model's linear layers through ``nn.Linear`` and
  through oneDNN (notebook 01).
- ``roofline`` (:mod:`.roofline`): the machine's float32 GEMM peak and memory bandwidth,
  then the engine's prefill, decode and workload FLOP/s against them (notebook 11).
- ``simulate`` and ``fit-simulator`` (:mod:`.simulate`): the simulator on a long
  workload, and fitting its cost model (:mod:`minivllm.sim.simulator_fit`).

Plot functions take a result and an optional Axes and return the Figure; they never run
anything. The names below are the ones notebooks and tests import from
``minivllm.bench``.
"""

from minivllm.bench.common import load_tokenizer
from minivllm.bench.kv_offload import offload_benchmark
from minivllm.bench.latency import (
    ChunkedPrefillResult,
    LatencyPoint,
    chunked_prefill_benchmark,
    format_latency_table,
    latency_benchmark,
    latency_key,
    latency_point,
    plot_chunked_prefill,
    plot_latency_vs_rate,
)
from minivllm.bench.linear import linear_benchmark
from minivllm.bench.memory import format_memory_report, kv_memory_report, kv_slots_held, plot_memory
from minivllm.bench.prefix_caching import prefix_caching_benchmark
from minivllm.bench.priority import format_priority_table, priority_benchmark, priority_workload
from minivllm.bench.simulate import format_simulation
from minivllm.bench.throughput import (
    ThroughputReport,
    engine_overhead,
    plot_throughput,
    throughput_benchmark,
)
from minivllm.bench.tools import (
    TOOL_LABELS,
    TOOLS,
    ToolResult,
    run_hf_continuous,
    run_hf_generate,
    run_hf_static,
    run_minivllm,
)
from minivllm.sim.replay import ReplayResult, replay_workload
from minivllm.sim.simulator_fit import fit_simulator, plot_cost_model_fit

__all__ = [
    "TOOLS", "TOOL_LABELS", "ToolResult", "ThroughputReport", "ReplayResult", "LatencyPoint",
    "ChunkedPrefillResult", "chunked_prefill_benchmark", "engine_overhead", "fit_simulator",
    "format_latency_table", "format_memory_report", "format_priority_table", "priority_benchmark",
    "priority_workload", "format_simulation", "kv_memory_report",
    "kv_slots_held", "latency_benchmark", "latency_point", "linear_benchmark", "load_tokenizer",
    "plot_chunked_prefill", "plot_cost_model_fit", "latency_key", "plot_latency_vs_rate", "plot_memory",
    "offload_benchmark", "plot_throughput", "prefix_caching_benchmark", "replay_workload", "run_hf_continuous",
    "run_hf_generate", "run_hf_static", "run_minivllm", "throughput_benchmark",
]
