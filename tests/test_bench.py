"""Benchmark functions on a tiny random model: they run, and the greedy outputs of every
tool agree with minivllm's. No timings are asserted (they depend on the machine)."""

import pytest
from torch import nn

from minivllm.bench import (
    TOOLS,
    chunked_prefill_benchmark,
    engine_overhead,
    format_priority_table,
    kv_memory_report,
    latency_benchmark,
    linear_benchmark,
    plot_chunked_prefill,
    plot_latency_vs_rate,
    plot_memory,
    plot_throughput,
    priority_benchmark,
    priority_workload,
    throughput_benchmark,
)
from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.sim.cost_model import CostModel
from minivllm.sim.replay import replay_workload
from minivllm.sim.simulator import make_simulated_engine
from minivllm.sim.workload import WorkloadRequest, make_workload
from minivllm.worker.linear_plan import onednn_available, plain_linears
from minivllm.worker.model_loader import make_tiny_model


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", seed=1)


def test_throughput_all_tools_greedy_identical(tiny):
    w = make_workload(None, 4, seed=0, prompt_len=(5, 40), output_len=(3, 12))
    report = throughput_benchmark(w, tiny, None, TOOLS, static_batch_size=2,
                                  engine_kwargs=dict(max_num_batched_tokens=32, device="cpu"), min_running=2)
    assert [r.tool for r in report.results] == list(TOOLS)
    assert report.matches == {"minivllm-torch-linear": 4, "minivllm-onednn-linear": 4,
                              "minivllm-transposed-linear": 4, "minivllm-async": 4, "hf-generate": 4,
                              "hf-static": 4, "hf-cb": 4}
    assert all(r.output_tokens == sum(x.max_tokens for x in w) for r in report.results)
    assert report.overhead["num_steps"] > 0 and 0 <= report.overhead["in_step"] < 1
    table = report.table()
    assert "one at a time" in table and "4/4" in table
    plot_throughput(report)


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
def test_linear_benchmark_times_both_backends(tiny):
    rows = linear_benchmark(tiny, rows=(1, 8), repeats=1)
    assert [r["rows"] for r in rows] == [1, 8]
    decoder_linears = len(plain_linears(tiny)) - 1  # not the vocabulary projection
    assert all(r["layers"] == decoder_linears for r in rows)
    assert all(r["torch s"] > 0 and r["onednn s"] > 0 and r["transposed s"] > 0 for r in rows)
    assert all(r["speed-up"] == r["torch s"] / r[f"{r['fastest']} s"] >= 1 for r in rows)
    # Every backend timed in the same interleaved rounds; the medians are the columns.
    assert all(len(t.samples) == 1 and r[f"{b} s"] == t.median for r in rows for b, t in r["timings"].items())
    assert all(isinstance(r["verdict"], str) and r["verdict"] for r in rows)
    assert all(type(m) is nn.Linear for m in plain_linears(tiny))  # swapped back afterwards


def test_throughput_rounds_are_interleaved_and_count_forward_passes(tiny):
    w = make_workload(None, 4, seed=0, prompt_len=(5, 40), output_len=(3, 12))
    report = throughput_benchmark(w, tiny, None, ["minivllm", "hf-generate", "hf-static"], static_batch_size=2,
                                  engine_kwargs=dict(max_num_batched_tokens=32, device="cpu"), rounds=3)
    assert report.rounds == 3 and all(len(walls) == 3 for walls in report.wall_s.values())
    assert all(len(report.timings[t].samples) == 3 and report.timings[t].unit == "tok/s" for t in report.wall_s)
    assert all(r.wall_s == sorted(report.wall_s[r.tool])[1] for r in report.results)  # the median round
    # Forward passes do not depend on the clock: one per output token one at a time, one per
    # output token of the longest request per static batch; every round the same engine steps
    # (the prefix cache is reset between rounds, so no round finds the last one's prompts).
    out = [r.max_tokens for r in w]
    assert report.forward_passes["hf-generate"] == sum(out)
    assert report.forward_passes["hf-static"] == max(out[:2]) + max(out[2:])
    assert report.forward_passes["minivllm"] < report.forward_passes["hf-static"]
    assert report.matches == {"hf-generate": 4, "hf-static": 4}
    assert "3 interleaved rounds" in report.table()
    plot_throughput(report)  # with error bars: the middle half of the rounds
    with pytest.raises(ValueError, match="rounds"):
        throughput_benchmark(w, tiny, None, ["minivllm"], rounds=0)


def test_tools_can_be_selected(tiny):
    w = make_workload(None, 2, seed=1, prompt_len=(5, 10), output_len=3)
    report = throughput_benchmark(w, tiny, None, ["minivllm"], engine_kwargs=dict(device="cpu"))
    assert [r.tool for r in report.results] == ["minivllm"] and report.matches == {}
    with pytest.raises(ValueError, match="unknown tools"):
        throughput_benchmark(w, tiny, None, ["vllm"])


def test_engine_overhead_from_trace(tiny):
    engine = LLMEngine(EngineConfig(log_stats_interval=None, device="cpu"), tiny, None)
    replay_workload(engine, make_workload(None, 6, seed=2, prompt_len=(5, 20), output_len=5))
    o = engine_overhead(engine.trace, min_running=6)
    assert o["num_steps"] >= 1 and 0 <= o["in_step"] < 1
    assert engine_overhead(engine.trace, min_running=100)["num_steps"] == 0


def test_kv_memory_arithmetic():
    w = [WorkloadRequest("a", [0] * 10, 6), WorkloadRequest("b", [0] * 17, 15)]  # 16 and 32 tokens
    m = kv_memory_report(w, block_size=16, max_model_len=64, kv_bytes_per_token=1, kv_cache_memory=128)
    assert (m["tokens_used"], m["paged_slots"], m["contiguous_slots"]) == (48, 48, 128)
    assert m["paged_waste"] == 0 and m["contiguous_waste"] == pytest.approx(1 - 48 / 128)
    assert m["fit_contiguous"] == 2
    assert m["fit_paged"] == 5  # 8 blocks: 1 + 2 + 1 + 2 + 1, the next needs 2 and 1 is left
    m = kv_memory_report(w, block_size=5, max_model_len=64)
    assert m["paged_slots"] == 20 + 35
    plot_memory(m)
    with pytest.raises(ValueError, match="max_model_len"):
        kv_memory_report(w, max_model_len=20)


def test_latency_benchmark_real_and_simulated(tiny):
    def real(**kw):
        return LLMEngine(EngineConfig(log_stats_interval=None, device="cpu", **kw), tiny, None)

    pts = latency_benchmark(real, [200.0], None, n=5, prompt_len=(5, 20), output_len=(2, 6))
    assert pts[0].num_requests == 5 and not pts[0].simulated
    cost = CostModel({"const": 0.02, "prefill_tokens": 1e-3, "decode_requests": 1e-3,
                      "decode_context": 0.0, "prefill_attention": 0.0}, meta={})

    def sim(**kw):
        return make_simulated_engine(cost, **kw)

    pts = latency_benchmark(sim, [1.0, 20.0], None, n=200, vocab_size=49152)
    assert all(p.simulated and p.num_requests == 200 for p in pts)
    assert all(p.ttft_p99 >= p.ttft_p50 and p.e2e_p99 >= p.e2e_p50 for p in pts)
    # ten times the load on the same engine: requests wait longer (simulated time is exact)
    assert pts[1].e2e_p50 > pts[0].e2e_p50
    plot_latency_vs_rate(pts)


def test_chunked_prefill_benchmark_runs(tiny):
    def make(**kw):
        return LLMEngine(EngineConfig(log_stats_interval=None, device="cpu", **kw), tiny, None)

    res = chunked_prefill_benchmark(make, num_decodes=3, decode_prompt_len=8, decode_tokens=6,
                                    long_prompt_len=100, inject_after_steps=2, chunk_budget=32)
    off, on = res
    assert not off.enable_chunked_prefill and off.max_num_batched_tokens == 103
    assert on.enable_chunked_prefill and on.max_num_batched_tokens == 32
    assert len(off.decode_itls) == len(on.decode_itls) == 3 * 5
    plot_chunked_prefill(res)


def test_chunked_prefill_simulated_removes_the_spike():
    cost = CostModel({"const": 0.02, "prefill_tokens": 1e-3, "decode_requests": 1e-3,
                      "decode_context": 0.0, "prefill_attention": 0.0}, meta={})

    def make(**kw):
        return make_simulated_engine(cost, **kw)

    off, on = chunked_prefill_benchmark(make, long_prompt_len=1024, chunk_budget=256, vocab_size=49152)
    # simulated seconds are exact: one 1024-token step against 256-token chunks
    assert off.max_itl == pytest.approx(0.02 + 1.024 + 8e-3)
    assert on.max_itl < off.max_itl / 3


def test_cli_has_bench(capsys):
    from minivllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "throughput" in out and "simulate-cluster" in out
    # Each subcommand lists its own options, and only those (as `vllm bench SUB --help`).
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--num-requests" in out and "--tools" in out and "--tp-sizes" not in out
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--tp-sizes", "2"])
    assert e.value.code == 2
    assert "unrecognized arguments: --tp-sizes" in capsys.readouterr().err


def test_every_bench_mode_gets_what_it_reads():
    """A mode reads only options its subcommand defines: parse each mode's defaults,
    then look up every ``args.NAME`` its module's source mentions."""
    import ast
    import inspect

    from minivllm.bench.cli import MODES, build_bench_parser

    parser = build_bench_parser()
    mains = {main.__name__ for main, _ in MODES.values()}
    for mode, (main, _) in MODES.items():
        args = parser.parse_args([mode])
        module = inspect.getmodule(main)
        # the mode's main and the module's helpers that take the parsed args (not another mode's main)
        functions = [f for f in ast.walk(ast.parse(inspect.getsource(module))) if isinstance(f, ast.FunctionDef)
                     and (f.name == main.__name__ or (f.name not in mains and "args" in {a.arg for a in f.args.args}))]
        read = {node.attr for f in functions for node in ast.walk(f)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"}
        missing = sorted(name for name in read if not hasattr(args, name))
        assert not missing, f"bench {mode} ({module.__name__}.{main.__name__}) reads {missing}"


@pytest.mark.real_model
def test_bench_serve_drives_both_servers_and_the_offline_engine():
    """Every row made every requested token: the server in each mode and offline."""
    pytest.importorskip("httpx")
    from minivllm.bench.serve import format_rows, make_prompts, serve_benchmark

    prompts = {2: make_prompts(3, 16, 1000, seed=0)}
    rates = {20.0: make_prompts(3, 16, 1000, seed=1)}  # Poisson arrivals, 20 requests/s
    rows = serve_benchmark(prompts, 4, {"max_num_batched_tokens": 64}, rates=rates)
    assert [(r.mode, r.rate) for r in rows] == [
        ("offline", None), ("server (thread)", None), ("server (thread)", 20.0),
        ("server (process)", None), ("server (process)", 20.0)]
    assert all(r.num_requests == 3 and r.output_tokens == 12 and r.output_tok_s > 0 for r in rows)
    assert all(r.itl_p50 > 0 and r.ttft_p99 >= r.ttft_p50 > 0 for r in rows)
    assert all(1 <= r.concurrency <= 3 for r in rows if r.rate)  # the most in flight at once
    table = format_rows(rows)
    assert table.count("\n") == 6  # a header, a rule, five rows
    assert table.count("20 req/s") == 2  # one rate row per server mode


@pytest.mark.real_model
def test_cli_bench_memory_and_simulate(capsys, tmp_path):
    from minivllm.entrypoints.cli import main

    assert main(["bench", "memory", "--figures", str(tmp_path)]) == 0
    assert main(["bench", "simulate", "--num-requests", "50"]) == 0
    out = capsys.readouterr().out
    assert "requests fit contiguous" in out and "50/50 requests finished" in out
    assert (tmp_path / "bench_memory.png").exists()


def test_prefix_caching_benchmark_saves_prefill_work(tiny):
    from minivllm.bench import prefix_caching_benchmark

    w = make_workload(None, 6, seed=3, prompt_len=(40, 50), output_len=4, shared_prefix_len=32)
    on, off = prefix_caching_benchmark(w, tiny, None, dict(block_size=8, device="cpu"), rounds=2)
    assert (on["prefix caching"], off["prefix caching"]) == ("on", "off")
    assert len(on["mean TTFT"].samples) == len(off["out tok/s"].samples) == 2  # one per round
    assert off["prompt tokens computed"] == off["prompt tokens"] and off["hit rate"] == 0
    # Every request after the first finds the 32 shared tokens (4 full blocks) cached.
    assert on["prompt tokens computed"] <= on["prompt tokens"] - 5 * 32
    assert on["hit rate"] > 0 and on["same outputs"] and off["same outputs"]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        prefix_caching_benchmark(w, tiny, None, dict(block_size=8, device="cpu"), rounds=0)


def test_offload_benchmark_serves_each_way_from_its_tier(tiny, tmp_path):
    from minivllm.bench import offload_benchmark

    (row,) = offload_benchmark(tiny, None, prompt_lens=(37,), rounds=2, block_size=8,
                               folder=str(tmp_path))
    # It raises unless RAM and disk each served the 32 tokens of the 4 full blocks before the
    # last token, and the first token was the same all four ways.
    assert [len(row[way].samples) for way in ("computed", "local hit", "from RAM", "from disk")] == [2] * 4
    assert row["KV MB"] > 0 and row["cpu_to_device GB/s"] > 0 and row["disk_to_device GB/s"] > 0
    assert len(list(tmp_path.glob("*/*.safetensors"))) >= 2 * 4


def test_speculative_benchmark_rows_keep_the_tokens():
    """Every row of ``bench speculative`` (fixed k and the engine's own choice) serves the
    copy workload with the same greedy tokens as k = 0, and says so."""
    from tiny_chat import tiny_chat_llm

    from minivllm.bench.speculative import KS, speculative_benchmark
    from minivllm.sim.workload import copy_workload

    llm = tiny_chat_llm()
    tokenizer = llm.llm_engine.tokenizer
    workload = copy_workload(tokenizer, 3, seed=0, text_len=(20, 30))
    rows = speculative_benchmark(workload, llm.llm_engine.model, tokenizer, KS, max_num_seqs=3)
    assert [r["k"] for r in rows] == list(KS)
    assert all(r["same tokens as k=0"] for r in rows)
    assert rows[0]["speedup"] == 1.0 and all(r["steps"] > 0 and r["out tok/s"] > 0 for r in rows)
    assert all(0 <= r["acceptance rate"] <= 1 for r in rows[1:])


def test_priority_benchmark_runs_both_policies_with_the_same_tokens(tiny):
    from minivllm.bench.priority import request_group

    w = priority_workload(None, num_batch=6, num_interactive=4, interactive_rate=20.0, seed=0,
                          batch_prompt_len=(30, 60), batch_output_len=(8, 16),
                          interactive_prompt_len=(5, 10), interactive_output_len=(2, 4))
    assert [r.arrival_time for r in w] == sorted(r.arrival_time for r in w)
    assert {request_group(r.request_id): r.priority for r in w} == {"batch": 1, "interactive": 0}
    rows, traces = priority_benchmark(w, tiny, None, engine_kwargs=dict(max_num_seqs=2))
    assert [r["policy"] for r in rows] == ["fcfs", "priority"]
    assert all(r["same tokens"] for r in rows)
    assert all(r["interactive TTFT p99 s"] >= r["interactive TTFT p50 s"] > 0 for r in rows)
    assert all(r["batch tok/s"] > 0 for r in rows)
    assert set(traces) == {"fcfs", "priority"}
    assert "interactive" in format_priority_table(rows)


@pytest.mark.multiprocess
def test_soak_loses_nothing_and_leaks_no_block_through_every_fault(tmp_path):
    """A short soak (the tiny model, a fault every 3 s: every fault of the cycle at least
    once, the engine core killed among them): nothing lost, no block leaked, the server
    restarted after its exit with status 1, and the table printed."""
    import argparse
    import asyncio

    from tiny_chat import save_tiny_chat

    from minivllm.bench import soak

    model = save_tiny_chat(tmp_path / "tiny")
    args = argparse.Namespace(model=model, seed=0, minutes=0.8, fault_interval=3.0,
                              faults=",".join(soak.FAULTS), concurrency=3, seats=4, max_waiting=4, log=None)
    report = asyncio.run(soak.soak(args, tmp_path / "serve.log"))
    assert report.served > 0 and report.lost == 0, report.table()
    assert set(report.faults) == set(soak.FAULTS), report.faults
    assert report.restarts >= 1 and set(report.exit_codes) == {1}, report.table()
    assert report.idle_kv_usage and not any(report.idle_kv_usage), report.idle_kv_usage
    assert "lost (must be 0)" in report.table()


@pytest.mark.multiprocess
def test_bench_disagg_serves_the_split_layout_with_one_engines_tokens(tmp_path):
    """The prefill/decode split (two processes, a shared KV folder, the router) serves the
    chat streams and the long prompts, and one fixed long prompt gets the greedy text the
    offline engine makes. (The other layouts are the router's and the server's own.)"""
    pytest.importorskip("httpx")
    from tiny_chat import save_tiny_chat

    from minivllm import LLM, SamplingParams
    from minivllm.bench.disagg import disagg_benchmark, fixed_prompt, format_disagg_table

    model = save_tiny_chat(tmp_path / "tiny")
    [row] = disagg_benchmark(model, chatters=2, chat_tokens=8, long_len=128, long_rate=2.0, long_tokens=2,
                             duration=3.0, layouts=("disaggregated",))
    assert row.layout == "disaggregated" and row.chat_requests >= 2 and row.long_requests >= 1
    assert 0 < row.itl[0] <= row.itl[1] <= row.itl[2] and 0 < row.long_ttft[0] <= row.long_ttft[1]
    assert row.chat_tok_s > 0
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [alone] = LLM(model, log_stats_interval=None).generate(
        [{"prompt_token_ids": fixed_prompt(128, 49152, 0)}], params, use_tqdm=False)
    assert row.probe == alone.outputs[0].text
    assert "disaggregated" in format_disagg_table([row])
