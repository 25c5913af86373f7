"""Serve a workload through an engine the way a server would, on the engine's own clock.

A benchmark of latency against request rate, the simulator and the fit of its cost model
all need the same loop: add each request once the clock passes its arrival time, step
while there is work, wait for the next arrival when there is none. It lives here, apart
from both, so that :mod:`minivllm.bench` and :mod:`minivllm.sim.simulator` can import it
without importing each other. With a real engine the clock is the wall clock; with a
simulated one (:func:`minivllm.sim.simulator.make_simulated_engine`) it is a virtual clock
that the loop advances instead of sleeping (notebook 09).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sim.workload import WorkloadRequest


@dataclass
class ReplayResult:
    outputs: dict[str, RequestOutput]
    """Final output of each request (empty when ``keep_outputs`` is False)."""
    num_added: int
    num_steps: int
    start: float
    end: float
    """Engine clock when the replay started (the workload's arrival times count from it)
    and at the last finish."""


def replay_workload(
    engine: LLMEngine,
    workload: Iterable[WorkloadRequest],
    on_finished: Callable[[RequestOutput], None] | None = None,
    keep_outputs: bool = True,
    wait: Callable[[float], None] | None = None,
) -> ReplayResult:
    """Serve ``workload`` on ``engine`` until every request has finished.

    ``wait`` defaults to ``time.sleep``, or to advancing the clock when it is a
    simulator's virtual clock. Arrival times are recorded as scheduled (open loop), so a
    late add counts against TTFT, as it would for a real client. ``on_finished`` sees
    each final output as it comes (the simulator summarises and drops them, so memory
    stays flat over thousands of requests)."""
    clock = engine.clock
    if wait is None:
        wait = clock.advance if hasattr(clock, "advance") else time.sleep
    requests = iter(workload)
    pending = next(requests, None)
    outputs: dict[str, RequestOutput] = {}
    t0 = clock()
    added = steps = 0
    while pending is not None or engine.has_unfinished_requests():
        now = clock()
        while pending is not None and t0 + pending.arrival_time <= now:
            engine.add_request(pending.request_id, {"prompt_token_ids": pending.prompt_token_ids},
                               pending.sampling_params(), arrival_time=t0 + pending.arrival_time,
                               priority=pending.priority)
            added += 1
            pending = next(requests, None)
        if engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    if keep_outputs:
                        outputs[out.request_id] = out
                    if on_finished is not None:
                        on_finished(out)
        elif pending is not None:
            wait(t0 + pending.arrival_time - now)
    return ReplayResult(outputs, added, steps, t0, clock())
