"""Executor: what runs the model for the engine, in one process or several (notebook 14).

The engine never calls a model runner itself. It hands each step's ``SchedulerOutput``
to its executor and gets a ``ModelRunnerOutput`` back; how many processes took part is
the executor's business:

* :class:`UniProcExecutor`: one model runner, in the engine's own process (the default).
* :class:`~minivllm.distributed.executor.MultiprocExecutor`: with tensor parallelism,
  rank 0's model runner here and ranks 1..T-1 in worker processes, each step's inputs
  broadcast to them around rank 0's forward pass.

So the model runner, the module learners read most, holds no distributed code.

In vLLM: ``vllm/v1/executor/abstract.py`` (``Executor``), ``uniproc_executor.py`` and
``multiproc_executor.py``.
"""

from __future__ import annotations

from minivllm.core.scheduler import SchedulerOutput
from minivllm.model_runner import ModelRunner, ModelRunnerOutput


class Executor:
    """The interface the engine uses: run a step, forget finished requests, shut down."""

    model_runner: ModelRunner
    """The runner in the engine's process (rank 0's, with tensor parallelism)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def remove_requests(self, request_ids: list[str]) -> None:
        """Forget what the runner keeps for these requests (they have finished)."""
        self.model_runner.remove_requests(request_ids)

    def shutdown(self) -> None:
        """Release what the executor started (idempotent); nothing for one process."""


class UniProcExecutor(Executor):
    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner
