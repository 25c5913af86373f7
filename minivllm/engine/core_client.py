"""Engine-core clients: where the async engine's engine core runs (notebook 10).

:class:`~minivllm.engine.async_llm.AsyncLLMEngine` is one front end (streams, tokenizing on a
thread, bounded waiting, aborts when a client goes). What it drives is a *client* of an
engine core, chosen by composition, and every client answers the same calls
(:class:`EngineCoreClient`):

* :class:`InprocClient`: an ``LLMEngine`` in this process, stepped on one worker thread
  (``AsyncLLMEngine(engine)``; the thread server, tests, notebook 10).
* :class:`~minivllm.engine.mp_client.AsyncMPClient`: an engine core in a process of its own
  (``minivllm.engine.core_proc``); ``minivllm serve`` uses it
  (:class:`~minivllm.engine.async_llm.AsyncMPEngine`).

In vLLM: ``vllm/v1/engine/core_client.py`` (``InprocClient``, ``AsyncMPClient``), used by
``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.processor import ProcessedPrompt, Processor
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

OnOutputs = Callable[[list[RequestOutput]], None]
OnDead = Callable[[BaseException], None]


class EngineCoreClient:
    """What the front end asks of an engine core, wherever it runs. The callbacks given
    to :meth:`start` are called on the event loop: each step's outputs, and the error
    once if the engine dies."""

    error: BaseException | None = None
    """Why the engine died; None while it serves."""
    num_waiting: int = 0
    """Requests the scheduler has not admitted yet, as of the last step."""
    num_running: int = 0
    """Requests running, as of the last step."""
    kv_cache_usage: float = 0.0

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        raise NotImplementedError

    async def wait_ready(self) -> None:
        """Until requests can be taken; EngineDeadError if that will never be."""

    async def shutdown(self) -> None:
        raise NotImplementedError

    # -- what the front end reads -----------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        raise NotImplementedError

    @property
    def processor(self) -> Processor:
        raise NotImplementedError

    @property
    def max_model_len(self) -> int | None:
        raise NotImplementedError

    @property
    def max_num_seqs(self) -> int:
        raise NotImplementedError

    @property
    def num_waiting_or_on_the_way(self) -> int:
        """Requests the scheduler has not admitted: waiting in it, or handed to this
        client and not yet seen by it."""
        raise NotImplementedError

    def in_use(self, request_id: str) -> bool:
        """Whether the id still belongs to a request here (a new one may not take it)."""
        raise NotImplementedError

    # -- requests ----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                          priority: int = 0) -> None:
        """Queue a checked request (ValueError/TypeError if the engine still refuses it)."""
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        """Abort before the next step (ids no longer in the engine are ignored)."""
        raise NotImplementedError

    async def get_metrics(self) -> list:
        raise NotImplementedError

    async def reset_prefix_cache(self) -> bool:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """An ``LLMEngine`` in this process, stepped on one worker thread.

    Every call into the engine (add, abort, step, metrics) runs on that thread, one after
    another: the engine is not thread-safe and never needs to be. One task keeps the
    thread stepping while any request is unfinished and sleeps when there is nothing to
    do. Aborts are collected and applied just before the next step, so an aborted
    request's KV blocks are free after that step."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """``engine``: the engine, or a function that builds it, called on the stepping
        thread: then that thread is the only one that ever runs the model. Better so on
        a CPU: PyTorch runs its operators on a team of threads per calling thread
        (OpenMP), and an engine built on one thread and stepped on another keeps two
        teams on the same cores; this was measured to make the thread server's decode
        steps 1.4x slower (``minivllm bench serve``, README)."""
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minivllm-engine")
        self.engine = engine if isinstance(engine, LLMEngine) else self._thread.submit(engine).result()
        self._aborts: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._busy = False
        self._on_the_way: set[str] = set()
        """Ids handed to :meth:`add_request`, not yet counted in ``num_waiting``."""
        self._counts_lock = threading.Lock()
        """Held while the stepping thread moves an id from ``_on_the_way`` into
        ``num_waiting`` (or refreshes the counts) and while the front end reads them, so
        that no admission check sees a request counted twice (a spurious 503) or not at all."""

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(
            self._run_loop(on_outputs, on_dead), name="minivllm-step-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.error is None:  # leave the engine clean for whoever uses it next
            await self.call(self._abort_all)
        await asyncio.to_thread(self._thread.shutdown, True)

    def _abort_all(self) -> None:
        pending = list(self.engine.scheduler.requests)
        if pending:
            self.engine.abort_request(pending)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    @property
    def is_ready(self) -> bool:
        return True

    @property
    def processor(self) -> Processor:
        return self.engine.processor

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    @property
    def num_waiting_or_on_the_way(self) -> int:
        with self._counts_lock:
            return self.num_waiting + len(self._on_the_way)

    def in_use(self, request_id: str) -> bool:
        # The engine refuses ids it holds; an id whose abort is pending would be aborted
        # again, with the new request under it, by the next step.
        return request_id in self._aborts or request_id in self._on_the_way

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the stepping thread, between two steps."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                          priority: int = 0) -> None:
        with self._counts_lock:  # counted from now (before anything else runs on the loop)
            self._on_the_way.add(request_id)
        try:
            await self.call(self._add, request_id, prompt, params, priority)
        finally:
            with self._counts_lock:
                self._on_the_way.discard(request_id)  # if the thread never got to it
        self._wakeup.set()

    def _add(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, priority: int) -> None:
        self.engine.add_request(request_id, prompt, params, priority=priority)
        self._snapshot(added=request_id)

    def abort(self, request_ids: list[str]) -> None:
        self._aborts.update(request_ids)
        if self._wakeup is not None:
            self._wakeup.set()

    async def get_metrics(self) -> list:
        return await self.call(self.engine.get_metrics)

    async def reset_prefix_cache(self) -> bool:
        return await self.call(self.engine.reset_prefix_cache)

    def _snapshot(self, added: str | None = None) -> None:
        scheduler = self.engine.scheduler
        with self._counts_lock:
            self.num_waiting = len(scheduler.waiting)
            self.num_running = len(scheduler.running)
            if added is not None:
                self._on_the_way.discard(added)  # now counted in num_waiting instead
        self.kv_cache_usage = self.engine.kv_cache_manager.usage

    def _step(self, aborts: set[str]) -> tuple[list[RequestOutput], bool]:
        live = [i for i in aborts if self.engine.has_request(i)]
        if live:
            self.engine.abort_request(live)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        self._snapshot()
        return outputs, self.engine.has_unfinished_requests()

    async def _run_loop(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        try:
            while True:
                if not (self._aborts or self._busy or self._wakeup.is_set()):
                    await self._wakeup.wait()
                # Clear before stepping: a request added during this step sets it again.
                self._wakeup.clear()
                # Take the pending aborts here, on the loop: the thread gets its own set.
                aborts, self._aborts = self._aborts, set()
                outputs, self._busy = await self.call(self._step, aborts)
                on_outputs(outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug or out-of-memory in a step: fail loudly
            logger.exception("the engine step loop failed; no more requests will be served")
            self.error = e
            on_dead(e)
