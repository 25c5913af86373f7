"""minivllm.entrypoints.openai.prometheus turns the engine's metric records into Prometheus' text format,
without a server: parsed back with prometheus_client's own parser."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from minivllm.entrypoints.openai.prometheus import render_metrics
from minivllm.metrics import Counter, Gauge, Histogram


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_records_become_families_with_one_sample_per_label_set():
    records = [
        Counter("minivllm:request_success", 3, {"finished_reason": "stop"}),
        Counter("minivllm:request_success", 2, {"finished_reason": "length"}),
        Gauge("minivllm:kv_cache_usage_perc", 0.25),
        Histogram("minivllm:time_to_first_token_seconds", count=3, sum=0.6,
                  buckets={0.1: 1, 1.0: 3, math.inf: 3}),
    ]
    text = render_metrics(records).decode()
    got = samples(text)
    assert got[("minivllm:request_success_total", (("finished_reason", "stop"),))] == 3
    assert got[("minivllm:request_success_total", (("finished_reason", "length"),))] == 2
    assert got[("minivllm:kv_cache_usage_perc", ())] == 0.25
    assert got[("minivllm:time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("minivllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("minivllm:time_to_first_token_seconds_count", ())] == 3
    assert got[("minivllm:time_to_first_token_seconds_sum", ())] == 0.6
    assert "# HELP minivllm:request_success_total Finished requests, by finish reason." in text
    assert text.count("# TYPE minivllm:request_success_total counter") == 1  # one family


def test_each_scrape_shows_only_the_records_it_was_given():
    first = samples(render_metrics([Gauge("minivllm:num_requests_running", 1)]).decode())
    assert first == {("minivllm:num_requests_running", ()): 1}
    assert samples(render_metrics([]).decode()) == {}
