"""Per-request timestamps and the latencies vLLM reports from them.

Definitions follow vLLM: queue time is first scheduled minus arrival; prefill time is
first token minus first scheduled; time to first token (TTFT) is first token minus
arrival, so TTFT = queue time + prefill time, and a server analysis reads the two apart
(a long TTFT from a long queue wants more capacity, one from a long prefill wants
chunking or prefix caching). Inter-token latencies (ITL) are the gaps between
consecutive output tokens; time per output token (TPOT) is their mean; decode time is
last token minus first token; end-to-end latency is finish minus arrival. All times are
``time.perf_counter()`` seconds (or simulated seconds when the simulated runner drives
the clock).

Percentiles everywhere in minivllm (figures, benchmarks, notebooks) come from
:func:`percentile`, so a figure and the sentence beside it quote the same number.

The second half of the module holds the engine-wide metrics (``LLM.get_metrics()``):
counters, gauges and histograms named like vLLM's, and the periodic log line.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from minivllm.spec_decode.metrics import SpecDecodingStats


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, NaN when there are none.

    Linear interpolation between the two nearest ranks (numpy's default method, the one
    vLLM's benchmark scripts use), so the median of an even count is the mean of the two
    middle values. One definition for every percentile minivllm reports.
    """
    if len(values) == 0:
        return float("nan")
    # Imported here: the scheduler imports this module, and it stays free of numpy and torch.
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache on first admission."""
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First token minus first scheduled: the part of TTFT spent computing the prompt
        (and waiting in steps shared with others), after the queue."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def ttft(self) -> float | None:
        """First token minus arrival: ``queue_time + prefill_time``."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        """Last token minus first token: the time spent streaming the rest."""
        if not self.token_times:
            return None
        return self.token_times[-1] - self.token_times[0]

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        itls = self.itls
        return sum(itls) / len(itls) if itls else None

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


# ---------------------------------------------------------------------------------------
# Engine metrics: what a production dashboard watches (notebook 09).
#
# The records below have the shape of vLLM's offline metrics API
# (``vllm.v1.metrics.reader``: ``LLM.get_metrics()`` returns Counters, Gauges and
# Histograms), and each maps one to one onto a Prometheus metric, so the HTTP server can
# export them unchanged. Names carry a ``minivllm:`` prefix where vLLM's carry ``vllm:``.
# ---------------------------------------------------------------------------------------

FINISH_REASONS = ("stop", "length", "abort")

# Bucket upper bounds (seconds or tokens), close to vLLM's own, so dashboards built for one
# read the other. Prometheus histograms are cumulative: bucket ``le`` counts every
# observation <= le, and the ``+Inf`` bucket counts them all.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Counter:
    """A count that only goes up (tokens processed, requests finished)."""

    name: str
    value: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Gauge:
    """A value read now that can go up or down (requests running, KV cache usage)."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Histogram:
    """A distribution kept as cumulative bucket counts, Prometheus style.

    ``buckets`` maps each upper bound ``le`` (ending with ``math.inf``) to the number of
    observations <= le; ``count`` and ``sum`` give the mean. Percentiles can only be
    estimated to bucket resolution: for exact ones use ``RequestOutput.metrics``.
    """

    name: str
    count: int
    sum: float
    buckets: dict[float, int]
    labels: dict[str, str] = field(default_factory=dict)


Metric = Counter | Gauge | Histogram


class _HistogramData:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)  # per bucket, not yet cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def to_metric(self, name: str) -> Histogram:
        return Histogram(name, self.count, self.sum,
                         dict(zip(self.bounds, itertools.accumulate(self.counts))))


@dataclass
class SchedulerStats:
    """The engine's state right now: read live, so gauges are true even when idle."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV blocks owned by some request (free cached blocks do not count)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since start (cumulative, in tokens)."""
    prefix_cache_hits: int = 0


class EngineStats:
    """Engine-wide counters and histograms, updated once per step and once per finished
    request (vLLM splits this into IterationStats and a PrometheusStatLogger).

    Latencies are observed when they happen: TTFT when a request's first token comes
    out, each ITL as its token comes out; queue, prefill and decode time and end-to-end
    latency when the request finishes (as vLLM does). So the TTFT and ITL histograms are
    current while long requests are still running.
    """

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = _HistogramData(TTFT_BUCKETS)
        self.itl = _HistogramData(ITL_BUCKETS)
        self.e2e = _HistogramData(REQUEST_LATENCY_BUCKETS)
        self.queue_time = _HistogramData(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = _HistogramData(REQUEST_LATENCY_BUCKETS)
        self.decode_time = _HistogramData(REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = _HistogramData(ITERATION_TOKENS_BUCKETS)
        self.spec_decoding: SpecDecodingStats | None = None
        """Drafts and acceptances, when speculative decoding is on (the engine sets it)."""

    def record_step(self, num_tokens: int, num_preempted: int,
                    got_token: list[RequestMetrics], num_new_tokens: list[int] | None = None) -> None:
        """One engine step: ``num_tokens`` scheduled, ``num_preempted`` requests
        preempted, and the metrics of every request that received tokens:
        ``num_new_tokens`` of them each (default 1; more with speculative decoding,
        where the tokens of one step arrive together: inter-token latencies of 0)."""
        self.iteration_tokens.observe(num_tokens)
        self.num_preemptions += num_preempted
        for i, m in enumerate(got_token):
            n = num_new_tokens[i] if num_new_tokens is not None else 1
            if n == 0:
                continue
            self.generation_tokens += n
            if len(m.token_times) == n:
                # vLLM counts a prompt once, when its prefill completes; a recompute
                # after preemption does not count it again.
                self.prompt_tokens += m.num_prompt_tokens
                self.ttft.observe(m.first_token_time - m.arrival_time)
            else:
                self.itl.observe(m.token_times[-n] - m.token_times[-n - 1])
            for _ in range(n - 1):
                self.itl.observe(0.0)

    def record_finished(self, m: RequestMetrics, finish_reason: str) -> None:
        self.request_success[finish_reason] = self.request_success.get(finish_reason, 0) + 1
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.queue_time is not None:  # None for a request aborted while still waiting
            self.queue_time.observe(m.queue_time)
        if m.prefill_time is not None:  # None for one aborted before its first token
            self.prefill_time.observe(m.prefill_time)
        if m.decode_time is not None:
            self.decode_time.observe(m.decode_time)

    def get_metrics(self, sched: SchedulerStats) -> list[Metric]:
        p = "minivllm:"
        return [
            Gauge(p + "num_requests_running", sched.num_running_reqs),
            Gauge(p + "num_requests_waiting", sched.num_waiting_reqs),
            Gauge(p + "kv_cache_usage_perc", sched.kv_cache_usage),
            Counter(p + "num_preemptions", self.num_preemptions),
            Counter(p + "prompt_tokens", self.prompt_tokens),
            Counter(p + "generation_tokens", self.generation_tokens),
            Counter(p + "prefix_cache_queries", sched.prefix_cache_queries),
            Counter(p + "prefix_cache_hits", sched.prefix_cache_hits),
            *(Counter(p + "request_success", n, {"finished_reason": reason})
              for reason, n in self.request_success.items()),
            self.ttft.to_metric(p + "time_to_first_token_seconds"),
            self.itl.to_metric(p + "inter_token_latency_seconds"),
            self.e2e.to_metric(p + "e2e_request_latency_seconds"),
            self.queue_time.to_metric(p + "request_queue_time_seconds"),
            self.prefill_time.to_metric(p + "request_prefill_time_seconds"),
            self.decode_time.to_metric(p + "request_decode_time_seconds"),
            self.iteration_tokens.to_metric(p + "iteration_tokens_total"),
            *self._spec_decoding_metrics(p),
        ]

    def _spec_decoding_metrics(self, p: str) -> list[Metric]:
        sd = self.spec_decoding
        if sd is None:
            return []
        return [
            Counter(p + "spec_decode_num_drafts", sd.num_drafts),
            Counter(p + "spec_decode_num_draft_tokens", sd.num_draft_tokens),
            Counter(p + "spec_decode_num_accepted_tokens", sd.num_accepted_tokens),
            *(Counter(p + "spec_decode_num_accepted_tokens_per_pos", n, {"position": str(i)})
              for i, n in enumerate(sd.num_accepted_tokens_per_pos)),
        ]


class LoggingStatLogger:
    """Writes vLLM's periodic one-line summary to the ``minivllm`` logger (INFO).

    Throughputs are averages over the interval since the previous line, computed from
    the same counters ``get_metrics()`` reports, so the log and the metrics agree.
    """

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval
        self.last_time = now
        self.last_prompt_tokens = 0
        self.last_generation_tokens = 0
        self.last_queries = 0
        self.last_hits = 0
        self.last_drafts = (0, 0, 0)

    def maybe_log(self, now: float, stats: EngineStats, sched: SchedulerStats) -> str | None:
        """Log (and return) the line if ``interval`` seconds have passed, else None."""
        elapsed = now - self.last_time
        if elapsed < self.interval or elapsed <= 0:
            return None
        queries = sched.prefix_cache_queries - self.last_queries
        hits = sched.prefix_cache_hits - self.last_hits
        line = (
            f"Avg prompt throughput: {(stats.prompt_tokens - self.last_prompt_tokens) / elapsed:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(stats.generation_tokens - self.last_generation_tokens) / elapsed:.1f} tokens/s, "
            f"Running: {sched.num_running_reqs} reqs, Waiting: {sched.num_waiting_reqs} reqs, "
            f"GPU KV cache usage: {100 * sched.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        sd = stats.spec_decoding
        if sd is not None:  # over the interval, as the other rates
            now_drafts = (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens)
            drafts, draft_tokens, accepted = (a - b for a, b in zip(now_drafts, self.last_drafts))
            self.last_drafts = now_drafts
            line += (f", Draft acceptance rate: {100 * accepted / draft_tokens if draft_tokens else 0.0:.1f}%, "
                     f"Mean acceptance length: {1 + accepted / drafts if drafts else 1.0:.2f}")
        logging.getLogger("minivllm").info(line)
        self.last_time = now
        self.last_prompt_tokens = stats.prompt_tokens
        self.last_generation_tokens = stats.generation_tokens
        self.last_queries = sched.prefix_cache_queries
        self.last_hits = sched.prefix_cache_hits
        return line
