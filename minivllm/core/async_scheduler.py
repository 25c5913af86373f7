"""AsyncScheduler: schedule step N+1 while step N still runs (``async_scheduling=True``).

Without it the engine does one thing at a time: schedule, run the model, read the
sampled tokens, check stops, make the outputs, and only then schedule again. Everything
but the model is time the model is idle. With async scheduling the model runs step N
while the engine's second thread processes step N-1's tokens and schedules step N+1
(``EngineCore._step_async``).

The catch is that step N+1 is scheduled before step N's tokens are known. A request
decoding in step N decodes again in step N+1, and the token step N+1 computes is the one
step N is sampling now. The scheduler counts it as a *placeholder*
(``Request.num_output_placeholders``): it plans the slot, the position and the blocks as
for any decode, and the model runner puts the token in just before the forward pass,
from what it sampled last (``ModelRunner.execute_step``). Two consequences:

* A request that stops in step N (its end-of-sequence token) has already been scheduled
  in step N+1. That token is computed and thrown away: a wasted row, never a wrong one.
  A request whose in-flight token is certainly its last (``max_tokens``, the model's
  length) is not scheduled again.
* A request whose next step needs the token itself on the host waits one step instead:
  its grammar's mask (structured output) and its penalties read what it has generated,
  so it is scheduled only once its tokens are processed, every other step.

Prompt chunks need no token from the step before, so chunk k+1 is scheduled while
chunk k runs.

In vLLM: ``vllm/v1/core/sched/async_scheduler.py`` (``AsyncScheduler``). There the GPU
runs step N while the CPU schedules step N+1 (``EngineCore.step_with_batch_queue``). On a
CPU the model's operators keep the cores busy themselves, and the engine's thread waits
for the interpreter lock: the overlap is small (notebook 11 draws it from the trace).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.request import Request

if TYPE_CHECKING:
    from minivllm.worker.model_runner import ModelRunnerOutput


class AsyncScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        """As :meth:`Scheduler.schedule`, and each request that samples in this step holds
        a placeholder for its token until the step's output is processed."""
        out = super().schedule()
        for s in out.scheduled:
            if s.samples:
                s.request.num_output_placeholders += 1
        return out

    def must_wait(self, request: Request) -> bool:
        """A request whose token is in flight runs ahead only when its next step needs
        nothing but that token's slot, and that token is not certainly its last."""
        n = request.num_output_placeholders
        if n == 0:
            return False
        params = request.sampling_params
        if request.grammar is not None or params.has_penalties:
            return True
        last = params.max_tokens is not None and request.num_output_tokens + n >= params.max_tokens
        return last or request.num_tokens + n >= self.max_model_len

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """The step's tokens replace its placeholders (finished and preempted requests
        included: the token was computed for them either way), then as without async."""
        self._release_placeholders(scheduler_output)
        return super().update_from_output(scheduler_output, model_runner_output)

    def rollback(self, scheduler_output: SchedulerOutput) -> None:
        """A failed step samples nothing: its placeholders go too. A step waits to run
        for a call of ``step()``, so a request in it may have been aborted meanwhile: it
        is finished, and nothing of it is left to undo."""
        self._release_placeholders(scheduler_output)
        live = [s for s in scheduler_output.scheduled if not s.request.is_finished]
        super().rollback(dataclasses.replace(scheduler_output, scheduled=live))

    @staticmethod
    def _release_placeholders(scheduler_output: SchedulerOutput) -> None:
        for s in scheduler_output.scheduled:
            if s.samples:
                s.request.num_output_placeholders -= 1
