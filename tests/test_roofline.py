"""minivllm bench roofline on a tiny model: the FLOP count against PyTorch's own counter,
and the benchmark's physics (more rows per weight, higher intensity). No timing is
asserted beyond being positive: speed depends on the machine."""

from __future__ import annotations

import pytest
import torch
from matplotlib.figure import Figure
from torch.utils.flop_counter import FlopCounterMode

from minivllm.bench.roofline import (
    ModelCost,
    RooflinePoint,
    RooflineReport,
    plot_roofline,
    roofline_benchmark,
)
from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.sim.workload import make_workload
from minivllm.worker.model_loader import make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_flops_match_pytorchs_counter(arch):
    """The linear and attention FLOPs of a 24-token prompt, as ModelCost counts them,
    against torch.utils.flop_counter on the model's own forward. Eager attention computes
    the full square of scores with two batched matmuls and masks half of it; ModelCost
    counts the causal half, so the two parts are compared separately."""
    model = make_tiny_model(arch)
    model.set_attn_implementation("eager")
    cost = ModelCost.from_model(model)
    n = 24
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.arange(3, 3 + n)[None], logits_to_keep=1)
    counts = {str(op): c for op, c in counter.get_flop_counts()["Global"].items()}
    attention = counts.pop("aten.bmm")  # QK^T and PV; the linear layers are mm / addmm
    linear = sum(counts.values())
    flops, kv = cost.chunk(0, n, samples=True)
    causal = cost.attn_flops_per_key * n * (n + 1) // 2
    assert flops - causal == linear
    assert cost.attn_flops_per_key * n * n == attention
    assert kv == cost.kv_bytes_per_token * 2 * n
    # A decode of one token after 9 cached ones: every weight once, 10 keys, no vocabulary if it does not sample.
    assert cost.chunk(9, 1, samples=False)[0] == 2 * cost.decoder_params + 10 * cost.attn_flops_per_key


def test_roofline_benchmark_on_a_tiny_engine():
    model = make_tiny_model("llama", vocab_size=512)
    engine = LLMEngine(EngineConfig(log_stats_interval=None, device="cpu", max_num_batched_tokens=64), model, None)
    workload = make_workload(None, 6, seed=0, prompt_len=(5, 40), output_len=(3, 8))
    report = roofline_benchmark(engine, workload, gemm_seconds=0.01, bandwidth_bytes=1 << 22, prefill=64,
                                decode_batches=(1, 8), context=16, repeats=2, decode_steps=3)
    names = [p.name for p in report.points]
    assert names == ["prefill, 64 tokens", "decode, batch 1, context 16", "decode, batch 8, context 16",
                     "throughput workload (6 requests)"]
    prefill, decode1, decode8, whole = report.points
    assert whole.steps == len(engine.trace.steps) > 1
    # A step point is the fastest of the steps of its kind, all of which it keeps.
    assert all(p.seconds == min(p.samples) and p.timing.samples == p.samples for p in (prefill, decode1, decode8))
    assert len(prefill.samples) == 2 and whole.samples == () and whole.timing.samples == (whole.seconds / whole.steps,)
    assert all(p.flops > 0 and p.seconds > 0 and p.bytes >= ModelCost.from_model(model).weight_bytes
               for p in report.points)
    # Reusing each weight for more rows raises the intensity: decode 1 < decode 8 < prefill.
    assert decode1.intensity < decode8.intensity < prefill.intensity
    assert report.peak_flop_s == max(g["flop_s"] for g in report.gemm) > 0
    assert {g["backend"] for g in report.gemm} == {"torch", "onednn", "transposed"}
    assert report.read_bytes_s > 0 and report.copy_bytes_s > 0
    assert all(report.bound(p.intensity) <= report.peak_flop_s for p in report.points)
    assert "of peak" in report.table() and len(report.table().splitlines()) == 5


def test_roofline_puts_the_compiled_engines_steps_beside_the_eager_ones():
    model = make_tiny_model("llama", vocab_size=512)
    eager = LLMEngine(EngineConfig(log_stats_interval=None, max_num_batched_tokens=64), model, None)
    compiled = LLMEngine(EngineConfig(log_stats_interval=None, max_num_batched_tokens=64,
                                      compilation_config={"mode": 3, "backend": "eager"}), model, None)
    report = roofline_benchmark(eager, None, gemm_seconds=0.01, bandwidth_bytes=1 << 22, others={"compiled": compiled},
                                prefill=32, decode_batches=(1, 4), context=8, repeats=1, decode_steps=2)
    assert [(p.name, p.setting) for p in report.points] == [
        (name, setting) for setting in ("eager", "compiled")
        for name in ("prefill, 32 tokens", "decode, batch 1, context 8", "decode, batch 4, context 8")]
    # The same prefill step: the same FLOPs and bytes, whatever ran it (a decode point is
    # the fastest of its steps, which may be a token longer on one engine than the other).
    assert (report.points[0].flops, report.points[0].bytes) == (report.points[3].flops, report.points[3].bytes)
    assert len(compiled.trace.steps) > 0 and " compiled " in report.table()
    legend = [t.get_text() for t in plot_roofline(report).axes[0].get_legend().get_texts()]
    assert sum("(compiled)" in t for t in legend) == 3 and sum("(eager)" in t for t in legend) == 3


def test_plot_roofline_draws_the_ceilings_and_one_point_per_step():
    report = RooflineReport("Test CPU", 2, peak_flop_s=100e9, read_bytes_s=10e9, copy_bytes_s=8e9,
                            points=[RooflinePoint("decode, batch 1", 0.3e9, 0.54e9, 0.06),
                                    RooflinePoint("prefill, 512 tokens", 110e9, 0.55e9, 1.5)],
                            linear_backend="torch")
    assert report.bound(0.5) == pytest.approx(5e9) and report.bound(200) == 100e9
    fig = plot_roofline(report)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["decode, batch 1: 5% of peak", "prefill, 512 tokens: 73% of peak"]
    roof = ax.lines[0].get_ydata()
    assert max(roof) == pytest.approx(100) and min(roof) < 100  # GFLOP/s: the flat and the slanted part
