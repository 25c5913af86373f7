"""The engine's metrics in Prometheus' text format, for the server's ``GET /metrics``.

The engine knows nothing of Prometheus: ``LLMEngine.get_metrics()`` returns plain
``Counter``, ``Gauge`` and ``Histogram`` records (``minivllm.metrics``), and this module
turns a list of them into the exposition text, through ``prometheus_client``'s custom
collector interface, with nothing kept between scrapes.

In vLLM: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) and
``vllm/v1/metrics/prometheus.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from minivllm.metrics import Counter, Gauge, Histogram

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The media type of the text :func:`render_metrics` returns."""

_HELP = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (1 = full).",
    "request_success": "Finished requests, by finish reason.",
    "http_requests": "HTTP responses, by handler and status code.",
}


class EngineMetricsCollector:
    """A Prometheus collector that turns ``get_metrics()`` records into metric families.

    Records of one name (e.g. ``request_success`` for each finish reason) become one
    family with one sample per label set. Names keep vLLM's colon style; Prometheus
    allows colons, and ``prometheus_client`` adds ``_total`` to counters.
    """

    def __init__(self, records: list[Counter | Gauge | Histogram]) -> None:
        self.records = records

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        for rec in self.records:
            labels = getattr(rec, "labels", None) or {}
            family = families.get(rec.name)
            if family is None:
                kind = {Counter: CounterMetricFamily, Gauge: GaugeMetricFamily,
                        Histogram: HistogramMetricFamily}[type(rec)]
                doc = _HELP.get(rec.name.split(":")[-1], rec.name.split(":")[-1].replace("_", " "))
                family = families[rec.name] = kind(rec.name, doc, labels=sorted(labels))
            values = [labels[k] for k in sorted(labels)]
            if isinstance(rec, Histogram):
                buckets = [("+Inf" if le == float("inf") else repr(float(le)), n) for le, n in rec.buckets.items()]
                family.add_metric(values, buckets, rec.sum)
            else:
                family.add_metric(values, rec.value)
        yield from families.values()


def render_metrics(records: list[Counter | Gauge | Histogram]) -> bytes:
    """The records in Prometheus' text exposition format (media type :data:`CONTENT_TYPE`).
    A fresh registry each time: a scrape shows exactly the records it was given."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineMetricsCollector(records))
    return generate_latest(registry)
