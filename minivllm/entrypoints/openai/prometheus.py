"""The engine's metrics in Prometheus' text format, for the server's ``GET /metrics``.

The engine knows nothing of Prometheus: ``LLMEngine.get_metrics()`` returns plain
``Counter``, ``Gauge`` and ``Histogram`` records (``minivllm.metrics``), and this module
turns a list of them into the exposition text, through ``prometheus_client``'s custom
collector interface, with nothing kept between scrapes. The router's ``/metrics``
(:func:`render_router_metrics`) is the same text for a fleet: each replica's samples,
labelled with the replica they came from, and the router's own counts.

In vLLM: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) and
``vllm/v1/metrics/prometheus.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from minivllm.metrics import Counter, Gauge, Histogram

if TYPE_CHECKING:  # the router imports this module
    from minivllm.entrypoints.router import RouterStats
    from minivllm.entrypoints.routing import ReplicaState

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


_ROUTER_OWN = {
    "minivllm:router_requests": ("counter", "Requests forwarded, per replica."),
    "minivllm:router_replica_failures": ("counter", "Times a replica failed and left rotation."),
    "minivllm:router_outstanding_requests": ("gauge", "Requests in flight, per replica."),
    "minivllm:router_replica_healthy": ("gauge", "1 while the replica is in rotation."),
}


class _Families:
    """A collector that yields metric families built beforehand."""

    def __init__(self, families: dict[str, Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families.values())


def render_router_metrics(replicas: Sequence[ReplicaState], texts: Sequence[str],
                          stats: RouterStats, own: Sequence[Counter | Gauge] = ()) -> bytes:
    """The router's ``/metrics``: every replica's scraped ``texts`` (one per replica, ""
    where it did not answer) re-labelled with ``replica``, so one Prometheus scrape of the
    router sees the whole fleet and a dashboard can still tell the replicas apart; then
    the router's own counts from ``stats``, the replicas' states and the records ``own``
    (its tenants')."""
    families: dict[str, Metric] = {}
    for replica, text in zip(replicas, texts):
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica.name}, s.value)
    for name, (kind, doc) in _ROUTER_OWN.items():
        families[name] = Metric(name, doc, kind)
    for r in replicas:
        lab = {"replica": r.name}
        families["minivllm:router_requests"].add_sample("minivllm:router_requests_total", lab,
                                                        stats.requests[r.name])
        families["minivllm:router_replica_failures"].add_sample(
            "minivllm:router_replica_failures_total", lab, stats.failures[r.name])
        families["minivllm:router_outstanding_requests"].add_sample(
            "minivllm:router_outstanding_requests", lab, r.outstanding)
        families["minivllm:router_replica_healthy"].add_sample(
            "minivllm:router_replica_healthy", lab, float(r.healthy))
    retries = families["minivllm:router_retries"] = Metric(
        "minivllm:router_retries", "Requests retried on another replica.", "counter")
    retries.add_sample("minivllm:router_retries_total", {}, stats.retries)
    failed = families["minivllm:router_prefill_failures"] = Metric(
        "minivllm:router_prefill_failures", "Disaggregated requests whose prefill instance failed.", "counter")
    failed.add_sample("minivllm:router_prefill_failures_total", {}, stats.prefill_failures)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    registry.register(EngineMetricsCollector(list(own)))
    return generate_latest(registry)
