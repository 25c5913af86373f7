"""Engine metrics (minivllm.metrics): values checked against the per-request timestamps,
the step trace and a hand-driven clock, not just "it ran"."""

from __future__ import annotations

import logging
import math

import pytest

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.metrics import Counter, Gauge, Histogram
from minivllm.worker.model_loader import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model("llama")


def by_name(metrics, name, **labels):
    found = [m for m in metrics if m.name == "minivllm:" + name and all(
        m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def prompts(*lengths, start=1):
    return [{"prompt_token_ids": [start + (7 * i + j) % 400 for j in range(n)]}
            for i, n in enumerate(lengths)]


def make_llm(model, **kw):
    kw.setdefault("log_stats_interval", None)
    return LLM(model, block_size=4, **kw)


def test_metric_names_and_types(tiny_model):
    llm = make_llm(tiny_model, num_kv_blocks=32)
    metrics = llm.get_metrics()
    kinds = {m.name: type(m) for m in metrics}
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert kinds["minivllm:" + g] is Gauge
    for c in ("num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries",
              "prefix_cache_hits", "request_success"):
        assert kinds["minivllm:" + c] is Counter
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "iteration_tokens_total"):
        assert kinds["minivllm:" + h] is Histogram
    # A fresh engine: everything zero.
    assert all(m.value == 0 for m in metrics if not isinstance(m, Histogram))
    assert all(m.count == 0 and m.buckets[math.inf] == 0 for m in metrics if isinstance(m, Histogram))


def test_counters_and_histograms_add_up(tiny_model):
    llm = make_llm(tiny_model, num_kv_blocks=64, max_num_batched_tokens=16)
    lengths = (5, 9, 3, 12)
    max_tokens = (4, 1, 6, 3)
    outs = llm.generate(prompts(*lengths),
                        [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens],
                        use_tqdm=False)
    metrics = llm.get_metrics()
    assert by_name(metrics, "prompt_tokens").value == sum(lengths)
    assert by_name(metrics, "generation_tokens").value == sum(max_tokens)
    assert by_name(metrics, "request_success", finished_reason="length").value == 4
    assert by_name(metrics, "request_success", finished_reason="stop").value == 0

    for o, n in zip(outs, max_tokens):
        m = o.metrics
        assert len(o.outputs[0].token_ids) == n
        assert m.ttft == pytest.approx(m.first_token_time - m.arrival_time)
        assert m.first_token_time == m.token_times[0]
        assert len(m.itls) == n - 1
        assert m.queue_time == pytest.approx(m.first_scheduled_time - m.arrival_time)
        # TTFT splits into time in the queue and time computing the prompt.
        assert m.prefill_time == pytest.approx(m.first_token_time - m.first_scheduled_time)
        assert m.ttft == pytest.approx(m.queue_time + m.prefill_time)
        assert m.decode_time == pytest.approx(m.token_times[-1] - m.token_times[0])

    ttft = by_name(metrics, "time_to_first_token_seconds")
    assert ttft.count == 4
    assert ttft.sum == pytest.approx(sum(o.metrics.ttft for o in outs))
    itl = by_name(metrics, "inter_token_latency_seconds")
    assert itl.count == sum(n - 1 for n in max_tokens)
    assert itl.sum == pytest.approx(sum(sum(o.metrics.itls) for o in outs))
    e2e = by_name(metrics, "e2e_request_latency_seconds")
    assert e2e.count == 4 and e2e.sum == pytest.approx(sum(o.metrics.e2e_latency for o in outs))
    queue = by_name(metrics, "request_queue_time_seconds")
    assert queue.count == 4 and queue.sum == pytest.approx(sum(o.metrics.queue_time for o in outs))
    prefill = by_name(metrics, "request_prefill_time_seconds")
    assert prefill.count == 4
    assert prefill.sum == pytest.approx(sum(o.metrics.prefill_time for o in outs))
    assert queue.sum + prefill.sum == pytest.approx(ttft.sum)
    decode = by_name(metrics, "request_decode_time_seconds")
    assert decode.count == 4 and decode.sum == pytest.approx(sum(o.metrics.decode_time for o in outs))

    it = by_name(metrics, "iteration_tokens_total")
    steps = list(llm.trace.steps)
    assert it.count == len(steps)
    assert it.sum == sum(s.num_tokens for s in steps)
    assert it.buckets[16] == len(steps)  # the budget is 16: no step exceeds it
    for h in (ttft, itl, e2e, queue, prefill, decode, it):
        counts = list(h.buckets.values())
        assert counts == sorted(counts), "cumulative buckets never decrease"
        assert list(h.buckets)[-1] == math.inf and counts[-1] == h.count

    # Idle again: the gauges say so.
    assert by_name(metrics, "num_requests_running").value == 0
    assert by_name(metrics, "num_requests_waiting").value == 0
    assert by_name(metrics, "kv_cache_usage_perc").value == 0


def test_gauges_follow_the_engine_mid_run(tiny_model):
    llm = make_llm(tiny_model, num_kv_blocks=32, max_num_seqs=2)
    engine = llm.llm_engine
    for i, p in enumerate(prompts(6, 6, 6)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    metrics = llm.get_metrics()
    step = llm.trace.steps[-1]
    assert by_name(metrics, "num_requests_running").value == 2 == step.num_running
    assert by_name(metrics, "num_requests_waiting").value == 1 == step.num_waiting
    usage = by_name(metrics, "kv_cache_usage_perc").value
    assert usage == pytest.approx(step.kv_cache_usage) and usage == pytest.approx(4 / 32)
    engine.abort_request(["0", "1", "2"])
    engine.step()
    metrics = llm.get_metrics()
    assert by_name(metrics, "kv_cache_usage_perc").value == 0
    assert by_name(metrics, "request_success", finished_reason="abort").value == 3
    # "2" was aborted while waiting: it has no queue time to observe; "0" and "1" were
    # aborted after their prompt step: a queue and a prefill time each, no decode time
    # beyond their first token.
    assert by_name(metrics, "request_queue_time_seconds").count == 2
    assert by_name(metrics, "request_prefill_time_seconds").count == 2


def test_preemptions_match_the_trace(tiny_model):
    # 6 blocks of 4 tokens; three requests that each grow to 16 tokens (4 blocks).
    llm = make_llm(tiny_model, num_kv_blocks=6)
    lengths = (6, 6, 6)
    outs = llm.generate(prompts(*lengths), SamplingParams(max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    metrics = llm.get_metrics()
    preempted = sum(len(s.preempted) for s in llm.trace.steps)
    assert preempted > 0
    assert by_name(metrics, "num_preemptions").value == preempted
    assert preempted == sum(o.metrics.num_preemptions for o in outs)
    # A recomputed prompt is not counted twice; every output token is counted once.
    assert by_name(metrics, "prompt_tokens").value == sum(lengths)
    assert by_name(metrics, "generation_tokens").value == 30
    assert by_name(metrics, "kv_cache_usage_perc").value == 0


def test_prefix_cache_counters(tiny_model):
    llm = make_llm(tiny_model, num_kv_blocks=32)
    shared = list(range(10, 18))  # two full blocks of 4
    a = {"prompt_token_ids": shared + [1, 2, 3]}
    b = {"prompt_token_ids": shared + [4, 5]}
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(a, params, use_tqdm=False)
    llm.generate(b, params, use_tqdm=False)
    metrics = llm.get_metrics()
    stats = llm.llm_engine.kv_cache_manager.prefix_cache_stats
    assert by_name(metrics, "prefix_cache_queries").value == 11 + 10 == stats.queries
    assert by_name(metrics, "prefix_cache_hits").value == 8 == stats.hits


def test_exact_latencies_and_log_line_with_a_manual_clock(tiny_model, caplog):
    now = [0.0]
    config = EngineConfig(block_size=4, num_kv_blocks=32, log_stats_interval=10.0)
    engine = LLMEngine(config, tiny_model, None, clock=lambda: now[0])
    engine.add_request("a", prompts(5)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", prompts(3, start=50)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    caplog.set_level(logging.INFO, logger="minivllm")
    caplog.clear()
    now[0] = 2.0
    engine.step()  # both prefill, first tokens at t=2
    now[0] = 2.5
    engine.step()
    assert not [r for r in caplog.records if "throughput" in r.message]  # 2.5 s < 10 s
    now[0] = 10.0
    engine.step()  # last tokens at t=10: both finish
    metrics = engine.get_metrics()
    ttft = by_name(metrics, "time_to_first_token_seconds")
    assert ttft.count == 2 and ttft.sum == 4.0
    assert ttft.buckets[1.0] == 0 and ttft.buckets[2.5] == 2
    itl = by_name(metrics, "inter_token_latency_seconds")
    assert itl.count == 4 and itl.sum == pytest.approx(2 * 0.5 + 2 * 7.5)
    assert itl.buckets[0.5] == 2 and itl.buckets[7.5] == 4
    e2e = by_name(metrics, "e2e_request_latency_seconds")
    assert e2e.sum == 20.0
    assert by_name(metrics, "request_queue_time_seconds").sum == 4.0
    # Scheduled at t=2 and first token at the end of that step, on a clock that did not
    # move during it: all of TTFT was queue; decode ran from t=2 to t=10.
    assert by_name(metrics, "request_prefill_time_seconds").sum == 0.0
    assert by_name(metrics, "request_decode_time_seconds").sum == 16.0

    lines = [r.message for r in caplog.records if "throughput" in r.message]
    assert lines == [
        "Avg prompt throughput: 0.8 tokens/s, Avg generation throughput: 0.6 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%"
    ]


def test_progress_bar_and_log_line_can_be_silenced(tiny_model, capsys, caplog):
    llm = make_llm(tiny_model, num_kv_blocks=32, log_stats_interval=None)
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    capsys.readouterr()
    llm.generate(prompts(4, 5), SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert [r for r in caplog.records if r.name.startswith("minivllm")] == []


def test_progress_bar_and_log_line_when_on(tiny_model, capsys, caplog):
    llm = make_llm(tiny_model, num_kv_blocks=32, log_stats_interval=1e-9)
    caplog.set_level(logging.INFO, logger="minivllm")
    caplog.clear()
    capsys.readouterr()
    llm.generate(prompts(4, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert "est. speed input:" in err and "toks/s, output:" in err
    lines = [r.message for r in caplog.records if r.message.startswith("Avg prompt throughput")]
    assert len(lines) == len(llm.trace.steps)  # an interval this short logs every step
    assert lines[0].endswith("Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: "
                             f"{100 * llm.trace.steps[0].kv_cache_usage:.1f}%, "
                             "Prefix cache hit rate: 0.0%")
    assert "GPU KV cache usage: 0.0%" in lines[-1]
