"""minivllm.viz.disagg (notebook 16): each figure draws the records it is given, fits inside
its own size and keeps its keys off the data."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
from figure_layout import layout_problems, overflow, points_under_keys

from minivllm import viz
from minivllm.sim.cost_model import CostModel
from minivllm.sim.replay import replay_workload
from minivllm.sim.simulator import make_simulated_engine
from minivllm.sim.workload import WorkloadRequest


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def clean(fig) -> None:
    assert overflow(fig) == (0.0, 0.0)
    assert points_under_keys(fig) == []
    assert layout_problems(fig) == []


@pytest.fixture(scope="module")
def interference():
    """Two chat streams on a simulated engine, and a 600-token prompt arriving among them:
    its chunks ride in two consecutive steps (the 512-token budget less two decodes)."""
    engine = make_simulated_engine(CostModel.load())
    chats = [WorkloadRequest(f"chat{i}", list(range(10 + i, 42 + i)), max_tokens=24) for i in range(2)]
    replay_workload(engine, chats + [WorkloadRequest("long", list(range(1000, 1600)), max_tokens=2,
                                                     arrival_time=0.3)])
    return engine.trace, ["chat0", "chat1"]


def test_interference_shades_each_run_of_prompt_steps_and_plots_every_gap(interference):
    trace, watched = interference
    fig = viz.plot_prefill_interference([("one engine", trace)], watched, time_source=trace.time_source)
    ax = fig.axes[0]
    bands = [p for p in ax.patches if p.get_gid() == "prefill:one engine"]
    steps = [s for s in trace.steps if any(c.request_id == "long" and c.is_prefill for c in s.scheduled)]
    assert len(bands) == 1 and [s.step for s in steps] == list(range(steps[0].step, steps[0].step + len(steps)))
    assert any(t.get_text().strip() == f"600 prompt tokens, {len(steps)} steps" for t in ax.texts)
    [points] = [line for line in ax.lines if line.get_gid() == "itl:one engine"]
    gaps = [1e3 * g for r in watched for g in trace.requests[r].itls]
    assert sorted(points.get_ydata()) == pytest.approx(sorted(gaps))
    assert max(gaps) == pytest.approx(1e3 * max(s.duration for s in steps))  # a gap is the step it waited for
    clean(fig)


def test_a_panel_without_the_watched_requests_is_a_strip_of_bands(interference):
    trace, watched = interference
    fig = viz.plot_prefill_interference([("engine", trace), ("elsewhere", trace)], ["nobody"])
    assert [len(ax.get_yticks()) for ax in fig.axes] == [0, 0]
    clean(fig)


def calls(step: int) -> list[viz.ConnectorCall]:
    per_layer = [viz.ConnectorCall(step, "worker side", "attention.forward", m, f"layer {i}")
                 for i in range(4) for m in ("wait_for_layer_load", "save_kv_layer")]
    return [viz.ConnectorCall(step, "scheduler side", "Scheduler.schedule", "build_connector_meta", "2 loads"),
            viz.ConnectorCall(step, "worker side", "ModelRunner.forward", "start_load_kv"),
            *per_layer,
            viz.ConnectorCall(step, "worker side", "ModelRunner.forward", "wait_for_save"),
            viz.ConnectorCall(step, "scheduler side", "Scheduler.update_from_output", "update_connector_output")]


def test_condense_folds_a_repeating_pattern_and_keeps_single_calls():
    folded = viz.condense_calls(calls(0) + calls(1))
    assert [(c.step, c.method, c.repeat) for c in folded[:6]] == [
        (0, "build_connector_meta", 1), (0, "start_load_kv", 1), (0, "wait_for_layer_load", 4),
        (0, "save_kv_layer", 4), (0, "wait_for_save", 1), (0, "update_connector_output", 1)]
    assert len(folded) == 12 and folded[0].note == "2 loads" and folded[2].note == ""  # per-layer notes dropped
    single = [viz.ConnectorCall(0, "worker side", "A.f", m) for m in ("a", "b", "a")]
    assert [c.repeat for c in viz.condense_calls(single)] == [1, 1, 1]  # a, b, a is no repetition


def test_the_sequence_diagram_draws_one_arrow_per_call_into_its_half():
    rows = viz.condense_calls(calls(0) + calls(1))
    fig = viz.plot_connector_calls([("producer", rows), ("consumer", rows[:6])])
    left, right = fig.axes
    arrows = [a for a in left.texts if (a.get_gid() or "").startswith("call:")]
    assert [a.get_gid() for a in arrows] == [f"call:{c.method}" for c in rows]
    heads = {name: x for x, name in enumerate(["Scheduler", "connector\n(scheduler side)", "connector\n(worker side)",
                                                "ModelRunner", "attention"])}
    for arrow, call in zip(arrows, rows):
        half = "connector\n(worker side)" if call.side == "worker side" else "connector\n(scheduler side)"
        assert arrow.xy[0] == heads[half] and arrow.xyann[0] == heads[call.caller.partition(".")[0]]
    assert any(t.get_text() == "wait_for_layer_load() x 4" for t in left.texts)
    assert len([a for a in right.texts if (a.get_gid() or "").startswith("call:")]) == 6
    clean(fig)


def test_tier_residency_fills_a_square_where_a_tier_holds_the_block():
    moments = [("computed", [{"engine", "RAM"}, {"engine", "RAM"}]), ("evicted", [{"RAM"}, {"disk"}]),
               ("restarted", [{"disk"}, set()])]
    fig = viz.plot_tier_residency(moments)
    ax = fig.axes[0]
    filled = sorted(tuple(p.get_gid().split(":")[1:4]) for p in ax.patches if p.get_gid().endswith(":in"))
    expected = sorted((tier, str(m), str(b)) for m, (_, blocks) in enumerate(moments)
                      for b, held in enumerate(blocks) for tier in held)
    assert filled == expected
    assert len(ax.patches) == 3 * 2 * 3  # a square per tier, block and moment
    clean(fig)


def test_measured_layouts_draw_each_percentile_in_milliseconds():
    rows = [SimpleNamespace(layout=name, itl=(0.05 * k, 0.08 * k, 0.9 * k), long_ttft=(2.0 * k, 3.0 * k))
            for k, name in enumerate(("one engine", "two replicas", "disaggregated"), start=1)]
    fig = viz.plot_disagg_layouts(rows)
    itl_ax, ttft_ax = fig.axes
    assert [p.get_height() for p in itl_ax.patches if p.get_gid() == "itl:two replicas"] == pytest.approx([100, 160, 1800])
    assert [p.get_height() for p in ttft_ax.patches if p.get_gid() == "long_ttft:disaggregated"] == pytest.approx(
        [6000, 9000])
    clean(fig)


def test_goodput_sweep_draws_each_layout_against_its_bounds():
    rows = [{"rate": r, "layout": name, "attainment": a, "ttft_p90": t, "tpot_p90": p}
            for name, scale in (("4 colocated", 1.0), ("2P+2D", 0.5))
            for r, a, t, p in ((0.25, 1.0, 2.0 * scale, 0.05 / scale), (0.5, 0.8, 8.0 * scale, 0.2 / scale))]
    fig = viz.plot_goodput_sweep(rows, 10.0, 0.12, time_source="simulated")
    share, ttft, tpot = fig.axes
    [line] = [ln for ln in share.lines if ln.get_gid() == "attainment:2P+2D"]
    assert list(line.get_xdata()) == [0.25, 0.5] and list(line.get_ydata()) == [100.0, 80.0]
    [line] = [ln for ln in tpot.lines if ln.get_gid() == "tpot_p90:4 colocated"]
    assert list(line.get_ydata()) == pytest.approx([50.0, 200.0])
    assert any(ln.get_ydata()[0] == 120.0 for ln in tpot.lines if ln.get_gid() is None)  # the bound
    clean(fig)


def test_the_figures_refuse_empty_inputs():
    with pytest.raises(ValueError, match="panel"):
        viz.plot_prefill_interference([], [])
    with pytest.raises(ValueError, match="calls"):
        viz.plot_connector_calls([("empty", [])])
    with pytest.raises(ValueError, match="same blocks"):
        viz.plot_tier_residency([("a", [set()]), ("b", [set(), set()])])
    with pytest.raises(ValueError, match="disagg_benchmark"):
        viz.plot_disagg_layouts([])
    with pytest.raises(ValueError, match="goodput_sweep"):
        viz.plot_goodput_sweep([], 1.0, 1.0)
