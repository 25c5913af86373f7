"""minivllm.viz: each figure shows what it claims, checked against the trace of a small
scripted run whose schedule is worked out by hand below."""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from figure_layout import layout_problems, overflow, points_under_keys
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.legend import Legend

from minivllm import LLM, SamplingParams, viz
from minivllm.metrics import percentile
from minivllm.viz import style
from minivllm.worker.model_loader import make_tiny_model


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model("llama")


def run(model, lengths, max_tokens, shared_prefix=(), **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 16)
    llm = LLM(model, log_stats_interval=None, **kw)
    prompts = [{"prompt_token_ids": list(shared_prefix) + [100 + 10 * i + j for j in range(n)]}
               for i, n in enumerate(lengths)]
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return llm.trace


@pytest.fixture(scope="module")
def trace(tiny_model):
    """Two requests (6 and 3 prompt tokens, 3 output tokens each), budget 8 tokens/step."""
    return run(tiny_model, (6, 3), 3, max_num_batched_tokens=8, enable_prefix_caching=False)


# The schedule, by hand: step 0 fills the budget of 8 with request 0's whole prompt (6)
# and the first 2 tokens of request 1's (a chunk); step 1 decodes request 0 and finishes
# request 1's prompt; step 2 decodes both (request 0 now has its 3 tokens); step 3 the
# last decode of request 1.
EXPECTED = [
    [("0", 6, True), ("1", 2, True)],
    [("0", 1, False), ("1", 1, True)],
    [("0", 1, False), ("1", 1, False)],
    [("1", 1, False)],
]


def test_the_scripted_schedule(trace):
    got = [[(c.request_id, c.num_new_tokens, c.is_prefill) for c in s.scheduled] for s in trace.steps]
    assert got == EXPECTED


def patches_by_gid(ax, prefix):
    return {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def test_batch_composition_bars_are_the_scheduled_tokens(trace):
    fig = viz.plot_batch_composition(trace)
    assert isinstance(fig, Figure)
    assert tuple(fig.get_size_inches()) == viz.BATCH_SIZE
    ax = fig.axes[0]
    bars = patches_by_gid(ax, "step:")
    assert len(bars) == sum(len(s) for s in EXPECTED)
    for step, chunks in enumerate(EXPECTED):
        bottom = 0
        for rid, n, is_prefill in chunks:
            bar = bars[f"step:{step}:{rid}"]
            assert bar.get_x() + bar.get_width() / 2 == pytest.approx(step)  # one group per step
            assert bar.get_height() == n and bar.get_y() == bottom  # stacked
            assert bool(bar.get_hatch()) == is_prefill  # prefill hatched, decode solid
            assert to_rgba(bar.get_facecolor()) == to_rgba(viz.request_color(rid))
            bottom += n
    # The token budget line.
    budget = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(budget) == 1 and list(budget[0].get_ydata()) == [8, 8]
    # The requests panel: one unit box per scheduled request, so a one-token decode is
    # as tall as a prompt chunk, stacked in the order the scheduler listed them.
    seats = patches_by_gid(fig.axes[1], "seat:")
    assert len(seats) == len(bars)
    for step, chunks in enumerate(EXPECTED):
        for i, (rid, _, is_prefill) in enumerate(chunks):
            seat = seats[f"seat:{step}:{rid}"]
            assert (seat.get_y(), seat.get_height()) == (i, 1)
            assert bool(seat.get_hatch()) == is_prefill
    # Every colour has a key: a legend entry per request.
    keyed = {t.get_text() for a in fig.axes for leg in a.findobj(Legend) for t in leg.get_texts()}
    assert {"0", "1"} <= keyed


def test_batch_composition_keeps_decodes_visible(tiny_model):
    # A 200-token prompt beside one-token decodes, under a budget of 2048: the token axis
    # is scaled to the largest step (the budget is noted, not drawn), so a decode is at
    # least 1/250 of the axis, and the requests panel gives it a full box.
    trace = run(tiny_model, (200, 3), 4, max_num_batched_tokens=2048, num_kv_blocks=64)
    fig = viz.plot_batch_composition(trace)
    tok_ax, seat_ax = fig.axes[:2]
    assert tok_ax.get_ylim()[1] < 250
    assert not [line for line in tok_ax.get_lines() if line.get_linestyle() == "--"]
    assert "2048" in tok_ax.get_title()
    decodes = [p for g, p in patches_by_gid(seat_ax, "seat:").items() if not p.get_hatch()]
    assert decodes and all(p.get_height() == 1 for p in decodes)
    assert seat_ax.get_ylim()[1] <= 3  # two requests at most: boxes fill the panel


def test_block_table_colours_exactly_the_owned_blocks(trace):
    record = trace.steps[0]
    # After step 0: request 0 holds 6 tokens (2 blocks), request 1 holds 2 (1 block).
    assert {r: len(t) for r, t in record.block_tables.items()} == {"0": 2, "1": 1}
    fig = viz.plot_block_table(trace, step=0)
    assert tuple(fig.get_size_inches()) == viz.BLOCK_TABLE_SIZE
    ax = fig.axes[0]
    cells = patches_by_gid(ax, "block:")
    assert len(cells) == trace.num_blocks == 16
    owner = {b: rid for rid, table in record.block_tables.items() for b in table}
    for b in range(trace.num_blocks):
        want = viz.request_color(owner[b]) if b in owner else viz.FREE_COLOR
        assert to_rgba(cells[f"block:{b}"].get_facecolor()) == to_rgba(want), b
    colored = [p for p in cells.values() if to_rgba(p.get_facecolor()) != to_rgba(viz.FREE_COLOR)]
    assert len(colored) == trace.num_blocks - record.num_free_blocks == 3

    # The default request is the one holding the most blocks: request 0, and its
    # logical blocks each point at the physical cell the block table names.
    logical = patches_by_gid(ax, "logical:")
    assert sorted(logical) == ["logical:0:0", "logical:0:1"]
    arrows = [c for c in ax.texts if getattr(c, "arrow_patch", None) is not None]
    assert len(arrows) == 2
    for arrow, b in zip(arrows, record.block_tables["0"]):
        cell = cells[f"block:{b}"]
        assert arrow.xy[0] == pytest.approx(cell.get_x() + 0.46)


def test_block_table_marks_shared_blocks(tiny_model):
    # Two prompts sharing 8 tokens (2 full blocks), admitted in the same step: request 1
    # adopts request 0's blocks from the prefix cache, so both blocks have ref count 2.
    trace = run(tiny_model, (3, 2), 2, shared_prefix=range(10, 18), max_num_batched_tokens=64)
    record = trace.steps[0]
    shared = {b for b, ref in record.block_ref_counts.items() if ref > 1}
    assert len(shared) == 2
    fig = viz.plot_block_table(trace, step=0, request_id="1")
    ax = fig.axes[0]
    cells = patches_by_gid(ax, "block:")
    hatched = {int(g.split(":")[1]) for g, p in cells.items() if p.get_hatch()}
    assert hatched == shared
    labels = {t.get_text() for t in ax.texts}
    assert {f"{b}\nref 2" for b in shared} <= labels
    assert len(patches_by_gid(ax, "logical:1:")) == len(record.block_tables["1"])


def test_block_table_bad_step(trace):
    with pytest.raises(IndexError, match="holds 4 steps"):
        viz.plot_block_table(trace, step=10)


def test_request_timeline_one_row_per_request(trace):
    fig = viz.plot_request_timeline(trace)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"]
    spans = {c.get_gid(): c for c in ax.collections if c.get_gid()}
    # Request 1 prefilled in steps 0 and 1 (two chunks) and decoded in steps 2 and 3:
    # one span each, with no gap between consecutive steps.
    assert len(spans["prefill:1"].get_paths()) == 1
    assert len(spans["decode:1"].get_paths()) == 1
    assert len(spans["prefill:0"].get_paths()) == 1
    assert not any(g.startswith("preempted") for g in spans)
    ticks = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    t0 = min(m.arrival_time for m in trace.requests.values())
    for rid, m in trace.requests.items():
        assert list(ticks[f"tokens:{rid}"].get_xdata()) == pytest.approx(
            [t - t0 for t in m.token_times])
    # Phases recovered from the trace, in the engine's clock: a step's span runs to the
    # next step's start.
    s = viz.request_spans(trace)
    steps = trace.steps
    assert s["1"]["prefill"] == [pytest.approx((steps[0].start, steps[2].start - steps[0].start))]
    assert s["1"]["decode"][0][0] == steps[2].start
    assert s["1"]["decode"][0][0] + s["1"]["decode"][0][1] == pytest.approx(steps[3].end)
    # The legend explains every mark: the phases this run has (no preemption here, so no
    # "preempted"), the token tick and the arrival dot.
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    phases = [k for k in ("waiting", "prefill", "decode", "preempted")
              if any(d > 0 for s in viz.request_spans(trace).values() for _, d in s[k])]
    assert "preempted" not in phases and {"prefill", "decode"} <= set(phases)
    assert labels[:len(phases)] == phases and "output token" in labels
    assert any(lbl.startswith("arrival") for lbl in labels)
    arrivals = {line.get_gid() for line in ax.get_lines() if (line.get_gid() or "").startswith("arrival")}
    assert arrivals == {"arrival:0", "arrival:1"}
    # Without the ticks (many long requests): no tick line and no key entry for them; no key at all.
    bare = viz.plot_request_timeline(trace, tokens=False).axes[0]
    assert not [line for line in bare.get_lines() if (line.get_gid() or "").startswith("tokens:")]
    assert "output token" not in [t.get_text() for t in bare.get_legend().get_texts()]
    assert viz.plot_request_timeline(trace, legend=False).axes[0].get_legend() is None


def test_latency_few_samples_are_dots_with_the_median(trace):
    fig = viz.plot_latency(trace)
    assert len(fig.axes) == 2
    ttft = [m.ttft * 1e3 for m in trace.requests.values()]
    itl = [x * 1e3 for m in trace.requests.values() for x in m.itls]
    assert len(itl) == 2 * (3 - 1) < viz.FEW_SAMPLES
    lines = {line.get_gid(): line for a in fig.axes for line in a.get_lines() if line.get_gid()}
    dots = {c.get_gid(): c for a in fig.axes for c in a.collections if c.get_gid()}
    for name, values in (("TTFT", ttft), ("ITL", itl)):
        assert sorted(dots[f"{name}:samples"].get_offsets()[:, 0]) == pytest.approx(sorted(values))
        assert lines[f"{name}:p50"].get_xdata()[0] == pytest.approx(percentile(values, 50))
        assert f"{name}:p99" not in lines  # a p99 of four values is only the largest
    assert not [p for a in fig.axes for p in a.patches]  # no histogram bars


def test_latency_histogram_with_percentiles(tiny_model):
    trace = run(tiny_model, (5, 4), 12)
    itl = [x * 1e3 for m in trace.requests.values() for x in m.itls]
    assert len(itl) == 22 >= viz.FEW_SAMPLES
    fig = viz.plot_latency(trace)
    lines = {line.get_gid(): line for line in fig.axes[1].get_lines() if line.get_gid()}
    for q in (50, 90, 99):
        assert lines[f"ITL:p{q}"].get_xdata()[0] == pytest.approx(percentile(itl, q))
    assert sum(p.get_height() for p in fig.axes[1].patches) == len(itl)  # histogram counts


def test_one_percentile_definition():
    # Linear interpolation between ranks: the median of an even count is the mean of the
    # two middle values (the upper-middle element, 4, is what a hand-rolled
    # sorted(xs)[n // 2] would give).
    assert percentile([1, 2, 4, 10], 50) == 3.0
    assert percentile([1, 2, 4, 10], 100) == 10.0
    assert math.isnan(percentile([], 50))


def test_kv_usage_and_preemptions(tiny_model):
    # 6 blocks of 4 tokens; three requests that each grow to 16 tokens: preemption.
    trace = run(tiny_model, (6, 6, 6), 10, num_kv_blocks=6)
    fig = viz.plot_kv_usage(trace)
    ax = fig.axes[0]
    usage = next(line for line in ax.get_lines() if line.get_gid() == "usage")
    assert list(usage.get_ydata()) == pytest.approx([100 * s.kv_cache_usage for s in trace.steps])
    assert usage.get_ydata()[-1] == 0  # all finished: nothing owned
    marks = next(c for c in ax.collections if c.get_gid() == "preemptions")
    want = [s.step for s in trace.steps if s.preempted]
    assert want and list(marks.get_offsets()[:, 0]) == want
    # The timeline shows the preempted spans of the preempted requests.
    spans = viz.request_spans(trace)
    victims = {rid for s in trace.steps for rid in s.preempted}
    assert {rid for rid, sp in spans.items() if sp["preempted"]} == victims
    # Each preempted span starts with the step that preempted the request: it was out of
    # that step's batch, so no gap opens between its last run and the red span.
    for rid in victims:
        assert [t for t, _ in spans[rid]["preempted"]] == [s.start for s in trace.steps if rid in s.preempted]
    keyed = [t.get_text() for t in viz.plot_request_timeline(trace).axes[0].get_legend().get_texts()]
    assert "preempted" in keyed


def test_memory_waste_numbers():
    held = viz.memory_waste([5, 17], [3, 10], block_size=4, max_model_len=64)
    assert held == {"contiguous": 128, "paged": 8 + 28, "stored": 8 + 27}
    fig = viz.plot_memory_waste([5, 17], [3, 10], block_size=4, max_model_len=64)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [128, 36, 35]


def test_memory_waste_from_a_trace(trace):
    fig = viz.plot_memory_waste(trace, max_model_len=32)
    heights = [p.get_height() for p in fig.axes[0].patches]
    # Prompts 6 and 3 plus 3 tokens each: 9 and 6 tokens, 3 + 2 blocks of 4.
    assert heights == [64, 20, 15]


def test_plots_draw_into_a_given_axes(trace):
    fig, ax = plt.subplots()
    assert viz.plot_batch_composition(trace, ax=ax) is fig
    assert viz.plot_kv_usage(trace, ax=ax) is fig
    assert viz.plot_request_timeline(trace, ax=ax) is fig
    assert viz.plot_block_table(trace, ax=ax) is fig


def test_replay_without_widgets_draws_the_first_step(trace):
    fig = viz.replay(trace)
    assert isinstance(fig, Figure)
    table, batch, seats = fig.axes
    assert "after step 0" in table.get_title()
    assert len(patches_by_gid(batch, "step:")) == 7
    assert len(patches_by_gid(seats, "seat:")) == 7
    assert "step 0 (gold):" in fig._suptitle.get_text()


def test_plot_steps_is_the_replay_as_one_picture(trace):
    # first (also the fullest cache and the most requests); first finish (request 0, step 2),
    # which is also the middle; last
    assert viz.pick_steps(trace) == [0, 2, 3]
    fig = viz.plot_steps(trace, steps=[0, 2])
    tok_ax, seat_ax, pool_a, pool_c = fig.axes
    assert len(patches_by_gid(tok_ax, "step:")) == 7
    assert "A: KV block pool after step 0" in pool_a.get_title()
    assert "B: KV block pool after step 2" in pool_c.get_title()
    # each pool panel shows that step's owners
    for ax, step in ((pool_a, 0), (pool_c, 2)):
        owned = {b for t in trace.steps[step].block_tables.values() for b in t}
        cells = patches_by_gid(ax, "block:")
        coloured = {int(g.split(":")[1]) for g, p in cells.items()
                    if to_rgba(p.get_facecolor()) != to_rgba(viz.FREE_COLOR)}
        assert coloured == owned
    with pytest.raises(IndexError):
        viz.plot_steps(trace, steps=[9])


def test_large_pools_are_drawn_up_to_the_blocks_used(tiny_model):
    trace = run(tiny_model, (6, 3), 2, num_kv_blocks=1000)
    fig = viz.plot_block_table(trace, step=0)
    cells = patches_by_gid(fig.axes[0], "block:")
    highest = max(b for s in trace.steps for t in s.block_tables.values() for b in t)
    assert len(cells) == 16 * (highest // 16 + 1) < 1000
    assert any("not drawn" in t.get_text() for t in fig.axes[0].texts)


def test_architecture_names_modules_that_exist():
    root = Path(viz.__file__).resolve().parents[2]  # the repository: viz is minivllm/viz/
    fig = viz.plot_architecture()
    ax = fig.axes[0]
    boxes = patches_by_gid(ax, "box:")
    assert {"box:engine", "box:scheduler", "box:kv", "box:runner", "box:attention", "box:sampler",
            "box:detokenizer", "box:server", "box:llm"} == set(boxes)
    named = [w for t in ax.texts for w in t.get_text().split() if w.endswith(".py") or w.endswith("/")]
    assert len(named) >= 10
    for path in named:
        assert (root / path).exists(), path


def test_architecture_arrows_and_labels_stay_off_other_boxes():
    # An arrow that cuts the corner of a box it does not join, or a label over a box's
    # edge, reads as a path through that part (the course review's notebook 00 figure).
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Annotation

    fig = viz.plot_architecture()
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = {gid[4:]: p.get_window_extent(renderer) for gid, p in patches_by_gid(ax, "box:").items()}
    arrows = [t for t in ax.texts if isinstance(t, Annotation)]
    assert len(arrows) == 11
    for arrow in arrows:
        ends = set(arrow.get_gid().removeprefix("flow:").split("->"))
        for poly in arrow.arrow_patch.get_path().to_polygons(closed_only=False):
            points = np.concatenate([np.linspace(p, q, 50) for p, q in zip(poly[:-1], poly[1:])])
            for key, box in boxes.items():
                if key not in ends:
                    assert not any(box.contains(x, y) for x, y in points), (arrow.get_gid(), key)
    for text in ax.texts:
        if isinstance(text, Annotation) or not text.get_text().strip():
            continue
        extent = text.get_window_extent(renderer)
        for key, box in boxes.items():  # a text is wholly inside a box or wholly outside it
            if box.overlaps(extent):
                assert (box.x0 <= extent.x0 and extent.x1 <= box.x1
                        and box.y0 <= extent.y0 and extent.y1 <= box.y1), (text.get_text(), key)


def test_flat_batch_draws_every_token_and_boundary():
    # a decode of request "a" (position 17) and a 3-token chunk of request "b" (positions 4-6)
    fig = viz.plot_flat_batch(
        input_ids=[11, 12, 13, 14], positions=[17, 4, 5, 6], slot_mapping=[33, 68, 69, 70],
        query_start_loc=[0, 1, 4], seq_lens=[18, 7], block_tables=[[5, 2], [4, 0]],
        request_ids=["a", "b"], block_size=16, logits_indices=[0, 3])
    ax = fig.axes[0]
    for name in ("input_ids", "positions", "slot_mapping"):
        assert len(patches_by_gid(ax, f"{name}:")) == 4
    cells = patches_by_gid(ax, "slot_mapping:")
    colors = viz.request_colors(["a", "b"])
    assert to_rgba(cells["slot_mapping:0"].get_facecolor())[:3] == to_rgba(colors["a"])[:3]
    assert to_rgba(cells["slot_mapping:1"].get_facecolor())[:3] == to_rgba(colors["b"])[:3]
    gids = {line.get_gid() for line in ax.get_lines()}
    assert {"qsl:0", "qsl:1", "qsl:2", "logits:0", "logits:3"} <= gids
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "request a: decode" in texts and "request b: prefill chunk" in texts
    with pytest.raises(ValueError, match="inconsistent"):
        viz.plot_flat_batch([1], [0, 1], [0, 1], [0, 2], [2], [[0]], ["a"], 16)


def test_request_colors_are_stable_distinct_and_never_grey():
    colors = [viz.request_color(str(i)) for i in range(18)]
    assert len(set(colors)) == 18
    assert viz.request_color("abc") == viz.request_color("abc")
    # Grey means a free block or a waiting request: no request may look like one.
    for rid, c in zip(range(18), colors):
        assert max(c) - min(c) > 0.1, f"request {rid} is drawn grey: {c}"
    for state in (viz.FREE_COLOR, style.WAITING_COLOR):
        assert max(to_rgba(state)[:3]) - min(to_rgba(state)[:3]) < 0.01


def test_save_figure(trace, tmp_path, monkeypatch):
    monkeypatch.delenv(viz.FIGURES_ENV, raising=False)
    assert viz.figures_dir().name == "figures"
    monkeypatch.setenv(viz.FIGURES_ENV, str(tmp_path / "elsewhere"))
    assert viz.figures_dir() == tmp_path / "elsewhere"
    monkeypatch.setattr(viz.saving, "figures_dir", lambda: tmp_path)
    saved = viz.save_figure(viz.plot_kv_usage(trace), "kv")
    assert saved == tmp_path / "kv.png" and Path(saved).stat().st_size > 0
    # In Jupyter it shows the file it wrote, byte for byte.
    assert saved._repr_png_() == (tmp_path / "kv.png").read_bytes()
    # The same figure saved twice gives the same bytes (no date stamp).
    again = viz.save_figure(viz.plot_kv_usage(trace), "kv2")
    assert Path(again).read_bytes() == Path(saved).read_bytes()
    assert viz.save_figure(viz.plot_kv_usage(trace), "kv.svg").path.suffix == ".svg"


def test_empty_trace_explains(tiny_model):
    llm = LLM(tiny_model, num_kv_blocks=8, log_stats_interval=None)
    with pytest.raises(ValueError, match="run the engine"):
        viz.plot_batch_composition(llm.trace)
    with pytest.raises(ValueError, match="run the engine"):
        viz.replay(llm.trace)


def test_replay_with_a_widget_frontend(trace, monkeypatch, capsys):
    import ipywidgets as widgets

    monkeypatch.setattr(viz.steps, "_has_widget_frontend", lambda: True)
    box = viz.replay(trace)
    assert isinstance(box, widgets.VBox)
    play, slider = box.children[0].children
    assert isinstance(play, widgets.Play) and isinstance(slider, widgets.IntSlider)
    assert slider.min == 0 and slider.max == len(trace.steps) - 1
    slider.value = 2  # redraws without error
    assert "Figure" in capsys.readouterr().out  # display() prints outside a kernel


def test_figures_stay_out_of_pyplot(trace):
    # Jupyter shows a returned figure once, and replay's redraws don't accumulate.
    plt.close("all")
    viz.plot_batch_composition(trace)
    viz.plot_latency(trace)
    viz.replay(trace)
    assert plt.get_fignums() == []


def test_ttft_breakdown_is_queue_plus_prefill(tiny_model):
    # Two seats, three requests: the third queues until a seat frees.
    trace = run(tiny_model, (5, 4, 6), 3, max_num_seqs=2)
    fig = viz.plot_ttft_breakdown(trace)
    ax = fig.axes[0]
    bars = patches_by_gid(ax, "")
    for rid, m in trace.requests.items():
        queue, prefill = bars[f"queue:{rid}"], bars[f"prefill:{rid}"]
        assert queue.get_width() == pytest.approx(m.queue_time * 1e3)
        assert prefill.get_x() == pytest.approx(m.queue_time * 1e3)  # stacked after the queue
        assert queue.get_width() + prefill.get_width() == pytest.approx(m.ttft * 1e3)
    # "2" waited for a seat through the whole first step (the cause; no race between clocks)
    assert trace.requests["2"].queue_time > trace.steps[0].duration
    assert trace.requests["2"].first_scheduled_time >= trace.steps[0].end


def test_plot_steps_one_request_per_step(trace):
    fig = viz.plot_steps(trace, steps=[0, 1], request_id=["1", "0"])
    assert len(patches_by_gid(fig.axes[2], "logical:1:")) == len(trace.steps[0].block_tables["1"])
    assert len(patches_by_gid(fig.axes[3], "logical:0:")) == len(trace.steps[1].block_tables["0"])
    with pytest.raises(ValueError, match="2 request ids for 1 steps"):
        viz.plot_steps(trace, steps=[0], request_id=["0", "1"])


def test_process_split_draws_both_processes_and_each_message():
    root = Path(viz.__file__).resolve().parents[2]
    ax = viz.plot_process_split().axes[0]
    assert set(patches_by_gid(ax, "process:")) == {"process:api_server", "process:engine_core"}
    arrows = {t.get_gid(): t for t in ax.texts if (t.get_gid() or "").startswith("message:")}
    assert set(arrows) == {"message:AddRequest", "message:Abort", "message:FinishRequests",
                           "message:StepOutputs"}
    # requests, aborts and finishes go to the core (arrow head to the right), outputs come back
    heads = {gid: a.xy[0] > a.xyann[0] for gid, a in arrows.items()}
    assert heads == {"message:AddRequest": True, "message:Abort": True, "message:FinishRequests": True,
                     "message:StepOutputs": False}
    for path in ("minivllm/engine/core_proc.py", "minivllm/engine/mp_client.py", "minivllm/entrypoints/openai/api_server.py"):
        assert any(path in t.get_text() for t in ax.texts) and (root / path).exists()


def test_priority_timeline_bars_come_from_the_metrics(tiny_model):
    # 6 blocks of 4 tokens, three requests growing to 16 tokens: preemption, under the
    # priority policy ("0" is the important one, so never the victim).
    llm = LLM(tiny_model, log_stats_interval=None, block_size=4, num_kv_blocks=6,
              scheduling_policy="priority")
    prompts = [{"prompt_token_ids": [100 + 10 * i + j for j in range(6)]} for i in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False,
                 priority=[0, 1, 1])
    trace = llm.trace
    groups = {"0": "interactive", "1": "batch", "2": "batch"}
    fig = viz.plot_priority_timeline(trace, groups)
    ax = fig.axes[0]
    bars = {c.get_gid(): c for c in ax.collections if c.get_gid()}
    t0 = min(m.arrival_time for m in trace.requests.values())
    for rid, m in trace.requests.items():
        path = bars[f"ttft:{rid}"].get_paths()[0].vertices
        assert (path[:, 0].min(), path[:, 0].max()) == pytest.approx(
            (m.arrival_time - t0, m.first_token_time - t0))
        path = bars[f"output:{rid}"].get_paths()[0].vertices
        assert (path[:, 0].min(), path[:, 0].max()) == pytest.approx(
            (m.first_token_time - t0, m.finished_time - t0))
    # Colour by group: both batch requests share one, the interactive one has another.
    color = {rid: tuple(bars[f"output:{rid}"].get_facecolor()[0]) for rid in groups}
    assert color["1"] == color["2"] != color["0"]
    victims = {rid for s in trace.steps for rid in s.preempted}
    assert victims and "0" not in victims
    assert {g.split(":")[1] for g in bars if g.startswith("preempted:")} == victims
    assert viz.plot_priority_timeline(trace, groups, ax=ax) is fig
    with pytest.raises(ValueError, match="groups"):
        viz.plot_priority_timeline(trace, {"nobody": "batch"})


def test_priority_timelines_side_by_side_share_time_and_one_key(tiny_model):
    traces = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(tiny_model, log_stats_interval=None, block_size=4, num_kv_blocks=8, max_num_seqs=1,
                  scheduling_policy=policy)
        prompts = [{"prompt_token_ids": [100 + 10 * i + j for j in range(6)]} for i in range(3)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                     **({"priority": [1, 1, 0]} if policy == "priority" else {}))
        traces[policy] = llm.trace
    groups = {"0": "batch", "1": "batch", "2": "interactive"}
    fig = viz.plot_priority_timelines(traces, groups)
    assert [ax.get_title() for ax in fig.axes] == ["fcfs", "priority"]
    assert fig.axes[0].get_shared_x_axes().joined(fig.axes[0], fig.axes[1])
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "batch: waiting for first token", "interactive: waiting for first token",
        "batch: generating", "interactive: generating", "preempted"]
    # One seat: under priority the interactive request, added last, is served first.
    first = {p: min(t.requests, key=lambda r: t.requests[r].first_token_time) for p, t in traces.items()}
    assert first == {"fcfs": "0", "priority": "2"}
    with pytest.raises(ValueError, match="no trace"):
        viz.plot_priority_timelines({}, groups)


def test_long_request_ids_stay_inside_the_figure(tiny_model):
    """A server's request ids are 40 characters: the steps figure (titles listing what ran,
    the request key) shortens them rather than growing past the page (notebook 10)."""
    import random

    llm = LLM(tiny_model, block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, log_stats_interval=None)
    engine = llm.llm_engine
    ids = [f"chatcmpl-{random.Random(i).getrandbits(128):032x}" for i in range(8)]  # vLLM's shape
    for i, rid in enumerate(ids):
        engine.add_request(rid, {"prompt_token_ids": [100 + i] * 5}, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    fig = viz.plot_steps(llm.trace)
    assert overflow(fig) == (0.0, 0.0)
    shown = {viz.short_id(rid) for rid in ids}
    assert len(shown) == len(ids) and max(map(len, shown)) <= 12, shown
    # and eight named requests get eight colours (hashing them into 18 shares some)
    bars = [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("step:")]
    by_request = {p.get_gid().split(":", 2)[2]: to_rgba(p.get_facecolor()) for p in bars}
    assert len(by_request) == 8 and len(set(by_request.values())) == 8


FIGURES = {  # each trace-drawing figure, with the arguments it needs besides the trace
    "plot_batch_composition": lambda t: viz.plot_batch_composition(t),
    "plot_block_table": lambda t: viz.plot_block_table(t, 1),
    "plot_block_table, a request's table": lambda t: viz.plot_block_table(t, 1, request_id="3"),
    "plot_kv_usage": lambda t: viz.plot_kv_usage(t),
    "plot_latency": lambda t: viz.plot_latency(t),
    "plot_ttft_breakdown": lambda t: viz.plot_ttft_breakdown(t),
    "plot_request_timeline": lambda t: viz.plot_request_timeline(t),
    "plot_steps": lambda t: viz.plot_steps(t),
    "plot_memory_waste": lambda t: viz.plot_memory_waste(t),
    "plot_priority_timeline": lambda t: viz.plot_priority_timeline(t, {r: f"group {int(r) % 2}" for r in t.requests}),
    "plot_architecture": lambda t: viz.plot_architecture(),
    "plot_process_split": lambda t: viz.plot_process_split(),
}


def test_a_full_pools_block_table_keeps_its_key_on_the_picture(tiny_model):
    """Notebook 07's picture: eight rows of blocks fill the figure's height, and the key
    below the request's table was cut off the saved picture (it was left out of the
    tight box because it was clipped to the axes)."""
    trace = run(tiny_model, [20] * 8, 3, shared_prefix=list(range(176)), block_size=16,
                num_kv_blocks=128, max_num_batched_tokens=2048)
    assert overflow(viz.plot_block_table(trace, 0, request_id="3")) == (0.0, 0.0)


@pytest.mark.parametrize("name", list(FIGURES))
def test_figures_draw_inside_their_own_size(name, tiny_model):
    """Nothing a figure draws (a title, a key, a label) reaches past the figure's edge,
    and no key covers a data point: the layout guard behind the reviews' clipped keys,
    over-wide pictures and keys over lines. Ten
    requests with a shared prefix, so keys, block tables and timelines have rows to show."""
    trace = run(tiny_model, [5 + 3 * i for i in range(10)], 4, shared_prefix=list(range(8)),
                num_kv_blocks=40, max_num_batched_tokens=24)
    fig = FIGURES[name](trace)
    assert overflow(fig) == (0.0, 0.0)
    assert points_under_keys(fig) == []
    assert layout_problems(fig) == []


def test_the_sweep_and_rate_figures_keep_their_keys_off_the_data():
    """Lines that run into every corner: the keys go under the panels, covering nothing."""
    from minivllm.bench.latency import LatencyPoint, plot_latency_vs_rate
    from minivllm.sim.cluster_simulator import SweepRow

    rows = [SweepRow(policy=p, num_replicas=n, num_requests=8, hit_rate=h, mean_ttft=m * scale,
                     p50_ttft=m * scale, p99_ttft=q * scale, throughput=1.0, min_requests=1, max_requests=2,
                     wall_seconds=0.0)
            for p, scale in (("round_robin", 1.0), ("least_outstanding", 0.9), ("prefix_aware", 0.5))
            for n, h, m, q in ((1, 0.2, 0.4, 1.2), (2, 0.9, 0.3, 1.1), (4, 0.1, 0.1, 1.15), (8, 0.95, 0.35, 1.2))]
    assert points_under_keys(viz.plot_cluster_sweep(rows)) == []
    # Latencies and throughput that grow with the rate, into the upper right corners.
    points = [LatencyPoint(rate=r, num_requests=8, duration_s=1.0, throughput=r ** 2, ttft_p50=r,
                           ttft_p99=r ** 2, itl_p50=r, itl_p99=r ** 2, e2e_p50=r, e2e_p99=r ** 2)
              for r in (0.5, 1.0, 2.0, 4.0)]
    assert points_under_keys(plot_latency_vs_rate(points)) == []


@pytest.mark.parametrize("plot", ["plot_request_timeline", "plot_priority_timeline"])
def test_the_simulated_times_note_sits_under_the_last_row(plot):
    """A simulated trace's timeline names its cost model in a corner note: the note is
    drawn below the last request's bar, not over it (notebook 09's two timelines)."""
    from minivllm.sim.cost_model import CostModel
    from minivllm.sim.simulator import make_simulated_engine

    engine = make_simulated_engine(CostModel.load(), max_num_seqs=4)
    for i in range(12):  # twelve requests at once: the last ones end last, at the right
        engine.add_request(str(i), {"prompt_token_ids": list(range(1, 40 + 8 * i))},
                           SamplingParams(max_tokens=8 + i, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.trace.time_source
    args = (engine.trace,) if plot == "plot_request_timeline" else (
        engine.trace, {str(i): "early" if i < 6 else "late" for i in range(12)})
    fig = getattr(viz, plot)(*args)
    ax = fig.axes[0]
    fig.draw_without_rendering()
    note = next(t for t in ax.texts if t.get_text().startswith("times: "))
    note_top = note.get_window_extent().y1
    bars = [c for c in ax.collections if (c.get_gid() or "").startswith(("waiting:", "prefill:", "decode:", "ttft:", "output:"))]
    assert bars
    lowest_bar = min(path.transformed(c.get_transform()).get_extents().y0
                     for c in bars for path in c.get_paths())
    assert note_top <= lowest_bar


@pytest.mark.multiprocess
def test_a_notebook_kernel_refuses_a_figure_with_a_layout_problem(tmp_path):
    """The guard nbval's kernels run under (notebooks/conftest.py): a figure a cell shows
    or saves with a layout problem fails that cell, whichever way the cell draws it
    (pyplot, a Figure as the cell's value, savefig), and a clean figure passes."""
    import nbformat
    from figure_layout import kernel_ipython_dir
    from nbclient import NotebookClient

    cells = {
        "clean": "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2], label='a')\n"
                 "ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1))\nax.set_title('fine')",
        "overlap": "fig, ax = plt.subplots(figsize=(3, 2))\n"
                   "ax.set_xticks(range(3), [f'request-{i:032x}' for i in range(3)])",
        "key over data": "from matplotlib.figure import Figure\ng = Figure()\nax = g.add_subplot()\n"
                         "ax.plot(range(10), [5] * 10, label='flat')\nax.legend(loc='center')\ng",
        "too wide": f"w = Figure(figsize=(30, 2))\nw.add_subplot().set_title('wide')\nw.savefig({str(tmp_path / 'w.png')!r})",
    }
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells.values()])
    env = {**os.environ, "IPYTHONDIR": kernel_ipython_dir()}
    env.pop("MPLBACKEND", None)
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    errors = {name: [o for o in cell.outputs if o.output_type == "error"]
              for name, cell in zip(cells, nb.cells)}
    assert errors["clean"] == [], errors["clean"]
    for name, says in (("overlap", "texts overlap"), ("key over data", "a key covers"), ("too wide", "px wide")):
        assert [e.ename for e in errors[name]] == ["FigureLayoutError"], (name, errors[name])
        assert says in errors[name][0].evalue, errors[name][0].evalue


# -- quantization (notebook 15) ----------------------------------------------------------------

def _ms(*samples: float, unit: str = "ms", higher_is_better: bool = False):
    from minivllm.bench.timing import Timing

    return Timing("t", tuple(samples), unit, higher_is_better)


def _heights(ax, gid: str) -> list[float]:
    return [p.get_height() for p in ax.patches if p.get_gid() == gid]


QUANTIZATION_FIGURES = {
    "plot_decode_bytes": lambda: viz.plot_decode_bytes(
        ["float32", "int8"], [500_000_000, 125_000_000], _ms(20.0, 25.0, 30.0, unit="GB/s", higher_is_better=True),
        [_ms(50, 60, 70), _ms(25, 30, 35)]),
    "plot_channel_maxima": lambda: viz.plot_channel_maxima(
        [0.1 + 3000.0 * (c == 700) for c in range(1536)], [0.5 + 8.0 * (c % 300 == 0) for c in range(1536)], "layer 11"),
    "plot_layer_errors": lambda: viz.plot_layer_errors(
        {"one scale per call": [0.05 + (i % 7 == 0) for i in range(30)], "one scale per token": [0.025] * 30,
         "weights only": [0.009] * 30}, highlight=11),
    "plot_quantization_tradeoff": lambda: viz.plot_quantization_tradeoff(
        ["float32", "int8"], [500_000_000, 125_000_000], [_ms(16, 17, 18), _ms(30, 31, 32)],
        [_ms(60, 66, 67), _ms(130, 134, 135)], [28.1, 28.9], [(5, 10), (4, 10)], batch_label="8 requests"),
    "plot_parting_step": lambda: viz.plot_parting_step(
        [".", " because", ",", " due", " is"], {"float32": [0.34, 0.29, 0.15, 0.08, 0.04],
                                                "int8": [0.27, 0.37, 0.13, 0.09, 0.04]},
        {"float32": ".", "int8": " because"}),
}


@pytest.mark.parametrize("name", list(QUANTIZATION_FIGURES))
def test_quantization_figures_draw_inside_their_own_size_with_keys_off_the_data(name):
    """Notebook 15's figures: nothing reaches past the figure's edge, no key covers a point
    (the keys go under the panels, where no data can be), no texts overlap."""
    fig = QUANTIZATION_FIGURES[name]()
    assert overflow(fig) == (0.0, 0.0)
    assert points_under_keys(fig) == []
    assert layout_problems(fig) == []


def test_decode_bytes_draws_the_weights_and_the_time_their_bytes_take():
    """Left: the megabytes. Right: bytes over the median bandwidth (500 MB at 25 GB/s is
    20 ms), its whisker over the bandwidth's middle half (22.5 to 27.5 GB/s), beside the
    measured step and its middle half."""
    fig = QUANTIZATION_FIGURES["plot_decode_bytes"]()
    left, right = fig.axes
    assert _heights(left, "weight_mb") == pytest.approx([500.0, 125.0])
    assert _heights(right, "floor:float32") == pytest.approx([20.0])
    assert _heights(right, "floor:int8") == pytest.approx([5.0])
    assert _heights(right, "measured:float32") + _heights(right, "measured:int8") == pytest.approx([60.0, 30.0])
    whiskers = [y for c in right.collections for seg in c.get_segments() for y in (seg[0][1], seg[1][1])]
    assert whiskers == pytest.approx([500 / 27.5, 500 / 22.5, 55.0, 65.0, 125 / 27.5, 125 / 22.5, 27.5, 32.5])


def test_quantization_tradeoff_panels_hold_the_numbers_given():
    fig = QUANTIZATION_FIGURES["plot_quantization_tradeoff"]()
    weights, decode, batch, ppl, answers = fig.axes
    assert _heights(weights, "weight_mb") == pytest.approx([500.0, 125.0])
    assert _heights(decode, "decode") == pytest.approx([17.0, 31.0])  # the medians
    assert _heights(batch, "batch") == pytest.approx([66.0, 134.0])
    assert _heights(ppl, "perplexity") == pytest.approx([28.1, 28.9])
    assert _heights(answers, "answers") == [5, 4]
    assert "of 10" in answers.get_title() and "8 requests" in batch.get_title()
    colors = [to_rgba(p.get_facecolor()) for p in decode.patches]
    assert colors == [to_rgba(viz.VARIANT_COLORS["float32"]), to_rgba(viz.VARIANT_COLORS["int8"])]


def test_channel_maxima_and_layer_errors_plot_every_value_on_a_log_axis():
    fig = QUANTIZATION_FIGURES["plot_channel_maxima"]()
    ax = fig.axes[0]
    first = next(line for line in ax.lines if line.get_gid() == "first_token")
    assert ax.get_yscale() == "log" and len(first.get_ydata()) == 1536 and max(first.get_ydata()) == 3000.1
    fig = QUANTIZATION_FIGURES["plot_layer_errors"]()
    ax = fig.axes[0]
    lines = {line.get_gid(): list(line.get_ydata()) for line in ax.lines if line.get_gid()}
    assert set(lines) == {"errors:one scale per call", "errors:one scale per token", "errors:weights only"}
    assert lines["errors:one scale per token"] == [0.025] * 30 and ax.get_yscale() == "log"
    assert "layer 11" in ax.get_title()


def test_parting_step_outlines_each_models_greedy_choice():
    fig = QUANTIZATION_FIGURES["plot_parting_step"]()
    ax = fig.axes[0]
    for name, chosen in (("float32", 0), ("int8", 1)):
        bars = [p for p in ax.patches if p.get_gid() == f"probabilities:{name}"]
        assert [b.get_width() for b in bars][:2] == ([0.34, 0.29] if name == "float32" else [0.27, 0.37])
        outlined = [i for i, b in enumerate(bars) if to_rgba(b.get_edgecolor()) == to_rgba("black")]
        assert outlined == [chosen]


def test_quantization_figures_refuse_mismatched_inputs():
    with pytest.raises(ValueError, match="one value per variant"):
        viz.plot_quantization_tradeoff(["float32", "int8"], [1], [], [], [], [])
    with pytest.raises(ValueError, match="one probability per token"):
        viz.plot_parting_step(["a", "b"], {"float32": [0.5]}, {})
    with pytest.raises(ValueError, match="one weight size and one step time"):
        viz.plot_decode_bytes(["float32"], [1, 2], _ms(1.0), [_ms(1.0)])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_overlap_shows_where_the_engine_worked(tiny_model, async_scheduling):
    """One at a time, no engine work falls inside a forward pass, by construction; with
    async scheduling each step is scheduled before the step before it is processed."""
    llm = LLM(tiny_model, async_scheduling=async_scheduling, log_stats_interval=None)
    llm.generate([{"prompt_token_ids": [5 + i, 6, 7] * 10} for i in range(4)],
                 SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    overlap = viz.step_overlap(llm.trace)
    assert overlap["engine"] > 0 and overlap["model"] > 0
    if not async_scheduling:
        assert overlap["hidden"] == 0
    fig = viz.plot_step_overlap(llm.trace, steps=range(2, 8))
    gids = {a.get_gid() for a in fig.axes[0].collections}
    assert {f"{kind}-{i}" for kind in ("model", "schedule", "output") for i in range(2, 8)} <= gids
    bars = {a.get_gid(): a.get_paths()[0].get_extents() for a in fig.axes[0].collections}
    for i in range(2, 7):  # the x where each bar starts
        scheduled_next, processed = bars[f"schedule-{i + 1}"].x0, bars[f"output-{i}"].x0
        assert (scheduled_next <= processed) == async_scheduling
    assert layout_problems(fig) == []
