"""Per-request timestamps and the latencies vLLM reports from them.

Definitions follow vLLM: queue time is first scheduled minus arrival; time to first token
(TTFT) is first token minus arrival; inter-token latencies (ITL) are the gaps between
consecutive output tokens; time per output token (TPOT) is their mean; end-to-end latency
is finish minus arrival. All times are ``time.perf_counter()`` seconds (or simulated
seconds when the simulated runner drives the clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

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
