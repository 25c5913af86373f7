"""The step trace: one plain record per engine step, from which every picture is drawn.

The engine appends a :class:`StepRecord` after each step; each request's timestamps live
in its :class:`~minivllm.metrics.RequestMetrics`. ``minivllm.viz`` reads these records
and never runs the engine, so a figure shows exactly what happened.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.metrics import RequestMetrics

if TYPE_CHECKING:
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.scheduler import Scheduler, SchedulerOutput
    from minivllm.executor.multiproc_executor import StepTiming


@dataclass
class ScheduledChunk:
    """What one request computed in one step: the trace's copy of the scheduler's
    ``ScheduledRequest`` (same field names), kept after the step is over."""

    request_id: str
    num_new_tokens: int
    num_computed_tokens: int
    """Tokens already cached before this step: the chunk covers the positions after it."""
    is_prefill: bool
    """Prompt (chunk) or recompute after preemption; False for a one-token decode."""
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens scored after the last token (in num_new_tokens)."""
    num_accepted_tokens: int = 0
    """Of those drafts, how many the target accepted (the step also gave one token more)."""


@dataclass
class StepTimes:
    """When a step's parts happened, on the engine's clock: scheduling runs from the
    record's ``start`` to ``scheduled``; then its inputs are packed; the model runs
    from ``model_start`` for ``model_time`` seconds; the output's processing runs from
    ``output_start`` to the record's ``end``.
    One after the other, or, with async scheduling, overlapping the steps around it
    (``minivllm.viz.plot_step_overlap``)."""

    scheduled: float
    """Scheduling done."""
    model_start: float | None
    """The forward pass began (None: the runner did not say: the simulator's)."""
    output_start: float
    """The engine turned to this step's output (with async scheduling, it may wait for it)."""


@dataclass
class StepRecord:
    step: int
    start: float
    end: float
    model_time: float
    """Seconds inside the model forward and sampling; the rest is engine overhead."""
    scheduled: list[ScheduledChunk]
    num_free_blocks: int
    num_blocks: int
    block_tables: dict[str, list[int]]
    """Physical block ids of every running request after this step."""
    block_ref_counts: dict[int, int]
    """Reference count of every owned block (>1 means shared through the prefix cache)."""
    preempted: list[str] = field(default_factory=list)
    prefix_cache_hits: dict[str, int] = field(default_factory=dict)
    """Tokens each newly admitted request found in the prefix cache."""
    external_cache_hits: dict[str, int] = field(default_factory=dict)
    """Tokens the KV connector loaded for each newly admitted request (after its hits)."""
    num_running: int = 0
    num_waiting: int = 0
    finished: list[str] = field(default_factory=list)
    parallel: StepTiming | None = None
    """With tensor parallelism: each rank's forward pass split into compute and
    communication (``minivllm.executor.multiproc_executor.StepTiming``); None otherwise."""
    times: StepTimes | None = None
    """When its scheduling, forward pass and output processing happened (None: a step
    that only preempted, with no forward pass)."""

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step, all requests together."""
        return sum(c.num_new_tokens for c in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.scheduled if c.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.scheduled if not c.is_prefill)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    """Everything a figure needs: the steps, the requests, and the engine's settings."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_steps: int | None = None
    """Keep only the last ``max_steps`` steps (long simulations keep memory flat)."""
    steps: deque[StepRecord] = field(default_factory=deque)
    requests: dict[str, RequestMetrics] = field(default_factory=dict)
    time_source: str | None = None
    """None: times are wall-clock seconds of a real run. Otherwise what made them up,
    e.g. "simulated (calibrated here, fitted on ...)": figures print it."""

    def __post_init__(self) -> None:
        self.steps = deque(self.steps, maxlen=self.max_steps)

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)
        if self.max_steps is not None and step.step % self.max_steps == 0 and self.steps:
            # A bounded trace also forgets requests that finished before its oldest step,
            # so a long-running server or simulation keeps flat memory.
            oldest = self.steps[0].start
            self.requests = {
                rid: m for rid, m in self.requests.items()
                if m.finished_time is None or m.finished_time >= oldest
            }

    def clear(self) -> None:
        self.steps.clear()
        self.requests.clear()


def make_step_record(step: int, scheduler_output: SchedulerOutput, scheduler: Scheduler,
                     kv: KVCacheManager, start: float, end: float, model_time: float, finished: list[str],
                     accepted: dict[str, int], parallel: StepTiming | None = None,
                     times: StepTimes | None = None) -> StepRecord:
    """The record of a step that has just run: what was scheduled, and the scheduler and
    KV cache as the step left them (block tables and reference counts copied)."""
    refs = {b.block_id: b.ref_cnt for blocks in kv.req_to_blocks.values() for b in blocks}
    return StepRecord(
        step=step,
        start=start,
        end=end,
        model_time=model_time,
        scheduled=[
            ScheduledChunk(s.request.request_id, s.num_new_tokens, s.num_computed_tokens, s.is_prefill,
                           len(s.spec_token_ids), accepted.get(s.request.request_id, 0))
            for s in scheduler_output.scheduled
        ],
        num_free_blocks=kv.block_pool.get_num_free_blocks(),
        num_blocks=kv.num_blocks,
        block_tables={r.request_id: kv.get_block_ids(r.request_id) for r in scheduler.running},
        block_ref_counts=refs,
        preempted=list(scheduler_output.preempted),
        prefix_cache_hits=dict(scheduler_output.prefix_cache_hits),
        external_cache_hits=dict(scheduler_output.external_cache_hits),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        finished=finished,
        parallel=parallel,
        times=times,
    )
